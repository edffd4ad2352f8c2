"""Unknown query parameters are refused, as unknown body fields are: ``/sleep?levle=2`` must
not sleep at the default level."""

from __future__ import annotations

from fastapi import Request
from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute

from dormant.server.errors import BadRequestError


async def forbid_unknown_query(request: Request) -> None:
    """A router dependency: 400 when the query names a parameter the route does not take."""
    route = request.scope.get("route")
    if not isinstance(route, APIRoute):
        return
    known = _query_names(route.dependant)
    unknown = sorted(set(request.query_params) - known)
    if unknown:
        raise BadRequestError(
            f"unknown query parameter(s) {unknown}; {route.path} takes "
            f"{sorted(known) or 'none'}. Nothing was done."
        )


def _query_names(dependant: Dependant) -> set[str]:
    """Every query parameter a route takes, its dependencies' included."""
    names = {param.alias for param in dependant.query_params}
    for child in dependant.dependencies:
        names |= _query_names(child)
    return names
