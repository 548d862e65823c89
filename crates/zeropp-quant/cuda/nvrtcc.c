/* nvrtcc: compiles one CUDA C++ file to PTX with NVRTC.
 *
 * Used by `cargo xtask ptx` because NVIDIA's nvcc wheels on PyPI (12.4-12.6)
 * ship `ptxas` but not the `nvcc` driver; NVRTC (nvidia-cuda-nvrtc-cu12) is
 * the same front end as a library. Usage: nvrtcc IN.cu OUT.ptx [NVRTC options...]
 * Prints the NVRTC version and the compile log; exits non-zero on any error
 * or warning. */
#include <nvrtc.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int check(nvrtcResult r, const char *what) {
    if (r != NVRTC_SUCCESS) {
        fprintf(stderr, "nvrtcc: %s: %s\n", what, nvrtcGetErrorString(r));
        return 1;
    }
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: nvrtcc IN.cu OUT.ptx [options...]\n");
        return 2;
    }
    FILE *f = fopen(argv[1], "rb");
    if (!f) { perror(argv[1]); return 1; }
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *src = malloc((size_t)n + 1);
    if (!src || fread(src, 1, (size_t)n, f) != (size_t)n) { fprintf(stderr, "nvrtcc: cannot read %s\n", argv[1]); return 1; }
    src[n] = 0;
    fclose(f);

    int major = 0, minor = 0;
    if (check(nvrtcVersion(&major, &minor), "nvrtcVersion")) return 1;
    printf("nvrtc %d.%d\n", major, minor);

    /* The program name (not the path) goes into the PTX, so keep it fixed. */
    const char *name = strrchr(argv[1], '/');
    name = name ? name + 1 : argv[1];
    nvrtcProgram prog;
    if (check(nvrtcCreateProgram(&prog, src, name, 0, NULL, NULL), "nvrtcCreateProgram")) return 1;
    nvrtcResult r = nvrtcCompileProgram(prog, argc - 3, (const char *const *)(argv + 3));
    size_t log_len = 0;
    nvrtcGetProgramLogSize(prog, &log_len);
    int warned = 0;
    if (log_len > 1) {
        char *log = malloc(log_len);
        if (log && nvrtcGetProgramLog(prog, log) == NVRTC_SUCCESS && log[0]) {
            fprintf(stderr, "%s\n", log);
            warned = 1;
        }
        free(log);
    }
    if (check(r, "compile")) return 1;
    if (warned) { fprintf(stderr, "nvrtcc: warnings are errors\n"); return 1; }
    size_t ptx_len = 0;
    if (check(nvrtcGetPTXSize(prog, &ptx_len), "nvrtcGetPTXSize")) return 1;
    char *ptx = malloc(ptx_len);
    if (!ptx || check(nvrtcGetPTX(prog, ptx), "nvrtcGetPTX")) return 1;
    FILE *o = fopen(argv[2], "wb");
    /* ptx_len counts the trailing NUL, which is not part of the text. */
    if (!o || fwrite(ptx, 1, ptx_len - 1, o) != ptx_len - 1 || fclose(o) != 0) { perror(argv[2]); return 1; }
    nvrtcDestroyProgram(&prog);
    return 0;
}
