/* A stand-in for libcuda.so.1 with the driver's process-checkpoint API, for CPU tests of
 * dormant/memory/process_checkpoint.py and its helper process. Built by the tests with gcc.
 *
 * It keeps the target's CUprocessState in a static (one helper process drives it) and follows
 * the driver's state machine: lock RUNNING->LOCKED, checkpoint LOCKED->CHECKPOINTED, restore
 * CHECKPOINTED->LOCKED, unlock LOCKED->RUNNING; any other transition is
 * CUDA_ERROR_ILLEGAL_STATE. Environment:
 *   FAKE_CUDA_LOG=path      appends "<op> <pid> [<timeout_ms>]" per call
 *   FAKE_CUDA_VERSION=n     what cuDriverGetVersion reports (default 12080)
 *   FAKE_CUDA_FAIL=op       that op fails (lock: CUDA_ERROR_TIMEOUT, state unchanged; others:
 *                           CUDA_ERROR_UNKNOWN, state unchanged)
 *   FAKE_CUDA_HANG=op       that op never returns
 *   FAKE_CUDA_EXIT=op       that op ends the process (a helper that dies)
 * Compiled with -DNO_CHECKPOINT_API it lacks the cuCheckpoint* symbols (a driver before 570).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define SUCCESS 0
#define ILLEGAL_STATE 401
#define TIMEOUT 909
#define UNKNOWN 999

static int state = 0; /* RUNNING */

int cuInit(unsigned int flags) { (void)flags; return SUCCESS; }

int cuDriverGetVersion(int *version) {
    const char *v = getenv("FAKE_CUDA_VERSION");
    *version = v ? atoi(v) : 12080;
    return SUCCESS;
}

int cuGetErrorName(int error, const char **name) {
    *name = error == TIMEOUT ? "CUDA_ERROR_TIMEOUT"
          : error == ILLEGAL_STATE ? "CUDA_ERROR_ILLEGAL_STATE" : "CUDA_ERROR_UNKNOWN";
    return SUCCESS;
}

int cuGetErrorString(int error, const char **text) {
    *text = error == TIMEOUT ? "the timeout expired" : "fake driver error";
    return SUCCESS;
}

#ifndef NO_CHECKPOINT_API
static int matches(const char *variable, const char *op) {
    const char *value = getenv(variable);
    return value && strcmp(value, op) == 0;
}

static int enter(const char *op, int pid, long timeout_ms) {
    const char *path = getenv("FAKE_CUDA_LOG");
    if (path) {
        FILE *log = fopen(path, "a");
        if (timeout_ms >= 0) fprintf(log, "%s %d %ld\n", op, pid, timeout_ms);
        else fprintf(log, "%s %d\n", op, pid);
        fclose(log);
    }
    if (matches("FAKE_CUDA_HANG", op)) for (;;) sleep(60);
    if (matches("FAKE_CUDA_EXIT", op)) _exit(3);
    if (matches("FAKE_CUDA_FAIL", op)) return strcmp(op, "lock") == 0 ? TIMEOUT : UNKNOWN;
    return SUCCESS;
}

static int step(const char *op, int pid, long timeout_ms, int from, int to) {
    int result = enter(op, pid, timeout_ms);
    if (result != SUCCESS) return result;
    if (state != from) return ILLEGAL_STATE;
    state = to;
    return SUCCESS;
}

int cuCheckpointProcessGetState(int pid, int *out) { (void)pid; *out = state; return SUCCESS; }

int cuCheckpointProcessLock(int pid, void *args) {
    return step("lock", pid, args ? (long)*(unsigned int *)args : -1, 0, 1);
}
int cuCheckpointProcessCheckpoint(int pid, void *args) { (void)args; return step("checkpoint", pid, -1, 1, 2); }
int cuCheckpointProcessRestore(int pid, void *args) { (void)args; return step("restore", pid, -1, 2, 1); }
int cuCheckpointProcessUnlock(int pid, void *args) { (void)args; return step("unlock", pid, -1, 1, 0); }
#endif
