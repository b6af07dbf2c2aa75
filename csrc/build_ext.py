"""Build the DualKV CUDA extension without setup.py (JIT, ninja) into a folder.

    python csrc/build_ext.py [OUT_DIR] [--python-include DIR] [--cta-trace] [--ops-namespace NAME]
        (OUT_DIR default: .gpu/build; MAX_JOBS=1 is honoured)

The result, OUT_DIR/_C.so, is found by megatron_dualkv/ops/cuda_backend.py through the
environment variable MEGATRON_DUALKV_CUDA_LIB or at .gpu/build/_C.so in the repository.
setup.py builds the same sources as the extension megatron_dualkv._C.

The library references the Python C API of the interpreter whose headers it was compiled with
(the op sources include torch/extension.h, i.e. pybind11), so a build for another machine must use
that machine's Python version: --python-include DIR (e.g. ~/.pyenv/versions/3.12.1/include/python3.12
for the lent GPU machine's Python 3.12) puts DIR's Python.h ahead of the running interpreter's.
A build made with 3.13's headers fails to load under 3.12 with "undefined symbol:
PyDict_GetItemStringRef". The torch build must match too (same version and CUDA).
--cta-trace compiles in the ws kernels' per-CTA clock stamps (csrc/cta_trace.h, read by
tools/cta_trace.py): a build for that tool, not for use (a default build has none of it).
--ops-namespace NAME registers the ops as torch.ops.NAME instead of torch.ops.megatron_dualkv
(csrc/ops_namespace.h): such a build loads beside a default one (MEGATRON_DUALKV_CUDA_LIB_EXTRA)
and MEGATRON_DUALKV_OPS=NAME runs a call on it, so that two builds are timed side by side in one
process (tools/bench_kernel.py cuda,cuda[MEGATRON_DUALKV_OPS=NAME] --interleave).
Where nvcc is reached through /usr/local/bin, set CUDA_HOME=/usr/local/cuda: torch would take
/usr/local and miss crt/host_defines.h.
"""
import argparse
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = [os.path.join(HERE, f) for f in ("dualkv_ops.cpp", "dualkv_kernels.cu", "dualkv_fwd_sm90.cu", "dualkv_bwd_sm90.cu",
                                                  "dualkv_ws_ops.cpp", "dualkv_fwd_ws_sm90.cu", "dualkv_bwd_ws_sm90.cu", "dualkv_dq_ws_sm90.cu")]
NVCC_FLAGS = ["-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "--use_fast_math",
              "-Xptxas=-v", "-lineinfo"]
CXX_FLAGS = ["-O3", "-std=c++17"]
DEFAULT_OPS_NAMESPACE = "megatron_dualkv"  # csrc/ops_namespace.h's MDKV_OPS_NS without a -D


def main():
    ap = argparse.ArgumentParser(description="Build the DualKV CUDA extension into a folder (JIT, ninja).")
    ap.add_argument("out", nargs="?", default=os.path.join(HERE, "..", ".gpu", "build"))
    ap.add_argument("--python-include", help="Python.h folder of the interpreter that will load the library")
    ap.add_argument("--cta-trace", action="store_true",
                    help="compile in the per-CTA clock stamps that tools/cta_trace.py reads (-DMDKV_CTA_TRACE)")
    ap.add_argument("--ops-namespace", default=DEFAULT_OPS_NAMESPACE,
                    help="torch op namespace of this build (another than megatron_dualkv: a build to load beside "
                         "a default one, MEGATRON_DUALKV_CUDA_LIB_EXTRA)")
    args = ap.parse_args()
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", args.ops_namespace):
        sys.exit(f"--ops-namespace {args.ops_namespace}: not a C identifier")
    out = os.path.abspath(args.out)
    includes = []
    if args.python_include:
        inc = os.path.abspath(os.path.expanduser(args.python_include))
        if not os.path.isfile(os.path.join(inc, "Python.h")):
            sys.exit(f"--python-include {args.python_include}: no Python.h there")
        includes.append(inc)  # -I, searched before the running interpreter's -isystem folder
    os.makedirs(out, exist_ok=True)
    from torch.utils.cpp_extension import load
    try:  # CUDA library headers (cusparse.h, ...) from the pip CUDA wheels, where the toolkit lacks them
        import nvidia
        for base in nvidia.__path__:
            inc = os.path.join(base, "cu13", "include")
            if os.path.isdir(inc):
                includes.append(inc)
    except ImportError:
        pass
    lib = os.path.join(out, "_C.so")
    try:
        ns = [f"-DMDKV_OPS_NS={args.ops_namespace}"]
        # a build to load beside another binds its own functions to itself (the two define the same
        # C++ names), also where the other was loaded RTLD_GLOBAL
        ld = ["-Wl,-Bsymbolic"] if args.ops_namespace != DEFAULT_OPS_NAMESPACE else []
        load(name="_C", sources=SOURCES, extra_cflags=CXX_FLAGS + ns,
             extra_cuda_cflags=NVCC_FLAGS + ns + (["-DMDKV_CTA_TRACE"] if args.cta_trace else []),
             extra_ldflags=ld, extra_include_paths=includes, build_directory=out, verbose=True,
             is_python_module=False)
    except OSError:
        # load() ends by loading the library here, which a build for another Python cannot do
        if not (args.python_include and os.path.isfile(lib)):
            raise
        print("built", lib, f"(for the Python of {args.python_include}; not loadable by this interpreter)")
        return
    print("built", lib)


if __name__ == "__main__":
    main()
