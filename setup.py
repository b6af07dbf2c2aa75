"""Install megatron_dualkv; build the CUDA extension (csrc/) where it can run.

The extension `megatron_dualkv._C` is built when torch is a CUDA build, nvcc is found, and either
a GPU is visible or MEGATRON_DUALKV_BUILD_CUDA=1. MEGATRON_DUALKV_BUILD_CUDA=0 skips it. Without
it the package installs and runs on its FlexAttention and reference backends.
"""

import glob
import os
import shutil

from setuptools import find_packages, setup


def _want_cuda() -> tuple[bool, str]:
    flag = os.environ.get("MEGATRON_DUALKV_BUILD_CUDA")
    if flag == "0":
        return False, "MEGATRON_DUALKV_BUILD_CUDA=0"
    try:
        import torch
    except ImportError:
        return False, "torch is not installed in the build environment (use --no-build-isolation)"
    if torch.version.cuda is None:
        return False, "torch is a CPU build"
    if shutil.which("nvcc") is None and not os.environ.get("CUDA_HOME"):
        return False, "nvcc not found"
    if not glob.glob("csrc/**/*.cu", recursive=True):
        return False, "no CUDA sources in csrc/"
    if flag == "1" or torch.cuda.is_available():
        return True, ""
    return False, "no GPU visible (set MEGATRON_DUALKV_BUILD_CUDA=1 to build anyway)"


def _cuda_extensions():
    """The fused DualKV kernels (csrc/), compiled for Hopper (sm_90a); module megatron_dualkv._C."""
    from torch.utils.cpp_extension import CUDAExtension

    files = ["dualkv_ops.cpp", "dualkv_kernels.cu", "dualkv_fwd_sm90.cu", "dualkv_bwd_sm90.cu",
             "dualkv_ws_ops.cpp", "dualkv_fwd_ws_sm90.cu", "dualkv_bwd_ws_sm90.cu", "dualkv_dq_ws_sm90.cu"]
    sources = [os.path.join("csrc", f) for f in files]
    includes = [os.path.abspath("csrc")]
    try:  # CUDA library headers from the pip CUDA wheels, for toolkits that lack them (cusparse.h)
        import nvidia

        includes += [p for base in nvidia.__path__ for p in [os.path.join(base, "cu13", "include")] if os.path.isdir(p)]
    except ImportError:
        pass
    return [
        CUDAExtension(
            name="megatron_dualkv._C",
            sources=sources,
            include_dirs=includes,
            extra_compile_args={
                "cxx": ["-O3", "-std=c++17"],
                "nvcc": ["-O3", "-std=c++17", "--use_fast_math", "-gencode=arch=compute_90a,code=sm_90a"],
            },
        )
    ]


ext_modules, cmdclass = [], {}
want, why = _want_cuda()
if want:
    from torch.utils.cpp_extension import BuildExtension

    ext_modules = _cuda_extensions()
    cmdclass = {"build_ext": BuildExtension}
else:
    print(f"megatron_dualkv: not building the CUDA extension ({why})")

setup(
    name="megatron_dualkv",
    version="0.1.0",
    description="Shared-prompt deduplicated (DualKV) GRPO/DAPO policy updates for Megatron-Core",
    packages=find_packages(include=["megatron_dualkv", "megatron_dualkv.*"]),
    package_data={"megatron_dualkv": ["data/*.jsonl", "data/*.parquet"]},
    python_requires=">=3.12",
    install_requires=["torch>=2.6", "megatron-core>=0.19,<0.20", "numpy"],
    extras_require={
        "data": ["pyarrow"],
        "test": ["pytest", "pyarrow", "matplotlib", "tqdm"],
        "cutlass": ["nvidia-cutlass"],
    },
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
