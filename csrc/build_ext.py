"""Build the DualKV CUDA extension without setup.py (JIT, ninja) into a folder.

    python csrc/build_ext.py [OUT_DIR]     (default: .gpu/build; MAX_JOBS=1 is honoured)

The result, OUT_DIR/_C.so, is found by megatron_dualkv/ops/cuda_backend.py through the
environment variable MEGATRON_DUALKV_CUDA_LIB or at .gpu/build/_C.so in the repository.
setup.py builds the same sources as the extension megatron_dualkv._C.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = [os.path.join(HERE, f) for f in ("dualkv_ops.cpp", "dualkv_kernels.cu", "dualkv_fwd_sm90.cu", "dualkv_bwd_sm90.cu",
                                                  "dualkv_ws_ops.cpp", "dualkv_fwd_ws_sm90.cu", "dualkv_bwd_ws_sm90.cu")]
NVCC_FLAGS = ["-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "--use_fast_math",
              "-Xptxas=-v", "-lineinfo"]
CXX_FLAGS = ["-O3", "-std=c++17"]


def main():
    out = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "..", ".gpu", "build"))
    os.makedirs(out, exist_ok=True)
    from torch.utils.cpp_extension import load
    includes = []
    try:  # CUDA library headers (cusparse.h, ...) from the pip CUDA wheels, where the toolkit lacks them
        import nvidia
        for base in nvidia.__path__:
            inc = os.path.join(base, "cu13", "include")
            if os.path.isdir(inc):
                includes.append(inc)
    except ImportError:
        pass
    load(name="_C", sources=SOURCES, extra_cflags=CXX_FLAGS, extra_cuda_cflags=NVCC_FLAGS,
         extra_include_paths=includes, build_directory=out, verbose=True, is_python_module=False)
    print("built", os.path.join(out, "_C.so"))


if __name__ == "__main__":
    main()
