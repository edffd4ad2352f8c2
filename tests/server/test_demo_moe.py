"""``dormant demo --model-family moe``: the RL cycle on a small random Qwen3-MoE, on the CPU
(fewer tokens than the real demo, so that CI stays fast): every check passes."""

from __future__ import annotations

from pathlib import Path

import pytest

from dormant import SamplingParams
from dormant.cli import build_parser, main
from dormant.cli import demo as demo_module
from dormant.models import ModelConfig


def test_the_parser_takes_the_model_family() -> None:
    args = build_parser().parse_args(["demo", "--model-family", "moe"])
    assert args.model_family == "moe"
    assert build_parser().parse_args(["demo"]).model_family == "dense"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo", "--model-family", "mamba"])


@pytest.mark.parametrize("size", ["tiny", "small"])
def test_the_moe_family_is_a_qwen3_moe(size: str) -> None:
    config = ModelConfig.from_dict(demo_module.hf_config(size, on_gpu=True, family="moe"))
    assert config.architecture == "Qwen3MoeForCausalLM" and config.moe is not None
    assert config.moe.num_experts_per_tok < config.moe.num_experts


def test_the_moe_demo_runs_the_rl_cycle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    short = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=6, ignore_eos=True)
    monkeypatch.setattr(demo_module, "PARAMS", short)
    png = tmp_path / "timeline.png"
    argv = ["demo", "--device", "cpu", "--model-family", "moe", "--png", str(png)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "random Qwen3-MoE" in out and "[ok] the refit changed the tokens" in out
    assert "[FAILED]" not in out and png.is_file()
