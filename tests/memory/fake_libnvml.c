/* A stand-in for libnvidia-ml.so.1, for CPU tests of the NVML readings the checkpoint helper
 * makes for a process whose CUDA state is locked (dormant/memory/nvml.py's calls only). Built
 * by the tests with gcc, next to the fake libcuda. Environment:
 *   FAKE_NVML_PROCESS=pid:bytes   the one process the device runs (none when unset)
 *   FAKE_NVML_MPS_CLIENT=pid      the one MPS client it runs, its memory not available (none
 *                                 when unset)
 *   FAKE_NVML_USED=bytes          the device's memory in use (default 1 GiB; total 141 GB)
 *   FAKE_CUDA_LOG=path            appends "nvml <caller's pid>" per process query
 */
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#define SUCCESS 0
#define INSUFFICIENT_SIZE 7

typedef struct { unsigned long long total, free, used; } Memory;
typedef struct { unsigned int pid; unsigned long long used; unsigned int gi, ci; } ProcessInfo;

int nvmlInit_v2(void) { return SUCCESS; }

int nvmlDeviceGetHandleByPciBusId_v2(const char *bus, void **handle) {
    (void)bus;
    *handle = (void *)1;
    return SUCCESS;
}

int nvmlDeviceGetMemoryInfo(void *handle, Memory *memory) {
    (void)handle;
    const char *used = getenv("FAKE_NVML_USED");
    memory->total = 141000000000ULL;
    memory->used = used ? strtoull(used, NULL, 10) : (1ULL << 30);
    memory->free = memory->total - memory->used;
    return SUCCESS;
}

int nvmlDeviceGetComputeRunningProcesses_v3(void *handle, unsigned int *count, ProcessInfo *infos) {
    (void)handle;
    const char *log = getenv("FAKE_CUDA_LOG");
    if (log) {
        FILE *f = fopen(log, "a");
        if (f) { fprintf(f, "nvml %d\n", (int)getpid()); fclose(f); }
    }
    const char *process = getenv("FAKE_NVML_PROCESS");
    unsigned int n = process ? 1 : 0;
    if (*count < n) { *count = n; return INSUFFICIENT_SIZE; }
    *count = n;
    if (n) {
        char *end;
        infos[0].pid = (unsigned int)strtoul(process, &end, 10);
        infos[0].used = strtoull(end + 1, NULL, 10);
        infos[0].gi = infos[0].ci = 0;
    }
    return SUCCESS;
}

int nvmlDeviceGetMPSComputeRunningProcesses_v3(void *handle, unsigned int *count, ProcessInfo *infos) {
    (void)handle;
    const char *client = getenv("FAKE_NVML_MPS_CLIENT");
    unsigned int n = client ? 1 : 0;
    if (*count < n) { *count = n; return INSUFFICIENT_SIZE; }
    *count = n;
    if (n) {
        infos[0].pid = (unsigned int)strtoul(client, NULL, 10);
        infos[0].used = ~0ULL; /* NVML_VALUE_NOT_AVAILABLE */
        infos[0].gi = infos[0].ci = 0;
    }
    return SUCCESS;
}
