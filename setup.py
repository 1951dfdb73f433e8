"""Build ddpx and its C++/CUDA extension ``ddpx._C``.

The extension is CPU-only when the installed torch has no CUDA, and CPU+CUDA
when it does. Set ``DDPX_CUDA=0`` to force a CPU build, ``DDPX_CUDA=1`` to
require a CUDA build (fails if torch or the toolkit cannot provide one).

Layout of ``csrc/`` (one small file per concern):
    csrc/module.cpp                  the Python module (pybind11): native comm hooks
    csrc/ops/<op>.cpp                operator schemas (TORCH_LIBRARY) + C++ entry points
    csrc/ops/cpu/<op>_kernel.cpp     CPU kernels (TORCH_LIBRARY_IMPL(ddpx, CPU))
    csrc/ops/cuda/<op>_kernel.cu     plain-CUDA kernels (no torch headers: nvcc-checkable)
    csrc/ops/cuda/<op>_glue.cpp      CUDA registration (TORCH_LIBRARY_IMPL(ddpx, CUDA))
    csrc/comm_hooks/*.cpp            native DDP comm hooks (c10d::CppCommHookInterface), built on the ops
"""

import glob
import importlib.util
import os
import shutil
import time

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _extension_build():
    """scripts/extension_build.py: the record of what ddpx._C was built from."""
    spec = importlib.util.spec_from_file_location("extension_build", os.path.join(ROOT, "scripts", "extension_build.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _version():
    with open(os.path.join(ROOT, "ddpx", "version.py")) as f:
        scope = {}
        exec(f.read(), scope)
        return scope["__version__"]


def _sources(pattern):
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))


def _want_cuda(torch, cuda_home):
    flag = os.environ.get("DDPX_CUDA", "auto").lower()
    has_cuda = torch.version.cuda is not None and cuda_home is not None
    if flag in ("0", "false", "no", "off"):
        return False
    if flag in ("1", "true", "yes", "on"):
        if not has_cuda:
            raise SystemExit(
                "DDPX_CUDA=1 but the installed torch has no CUDA or no CUDA toolkit was found "
                "(set CUDA_HOME); unset DDPX_CUDA for a CPU build"
            )
        return True
    return has_cuda


def _extensions():
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, CppExtension, CUDAExtension

    common = (
        _sources("csrc/*.cpp")
        + _sources("csrc/ops/*.cpp")
        + _sources("csrc/ops/cpu/*.cpp")
        + _sources("csrc/comm_hooks/*.cpp")
    )
    cxx_flags = ["-O3", "-std=c++17", "-fopenmp", "-fno-math-errno"]
    link_flags = ["-fopenmp"]
    include_dirs = [os.path.join(ROOT, "csrc")]
    if _want_cuda(torch, CUDA_HOME):
        sources = common + _sources("csrc/ops/cuda/*.cu") + _sources("csrc/ops/cuda/*.cpp")
        nvcc_flags = ["-O3", "-std=c++17"]  # no fast-math: GPU results must match the CPU kernels bit for bit
        return [
            CUDAExtension(
                "ddpx._C",
                sources,
                include_dirs=include_dirs,
                define_macros=[("DDPX_WITH_CUDA", "1")],
                extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
                extra_link_args=link_flags,
            )
        ]
    return [
        CppExtension(
            "ddpx._C",
            common,
            include_dirs=include_dirs,
            extra_compile_args={"cxx": cxx_flags},
            extra_link_args=link_flags,
        )
    ]


def _cmdclass():
    import torch
    from torch.utils.cpp_extension import BuildExtension

    stamps = _extension_build()

    class BuildOnce(BuildExtension.with_options(use_ninja=True)):
        """torch's BuildExtension, but an in-place ddpx/_C*.so built from the same sources,
        torch and settings is reused, not compiled again (scripts/extension_build.py)."""

        def run(self):
            # recorded before compiling: a source edited meanwhile makes the next build compile
            cuda = any(isinstance(ext.sources, list) and any(s.endswith(".cu") for s in ext.sources)
                       for ext in self.extensions)
            self._record = stamps.build_record(ROOT, torch.__version__, cuda)
            super().run()
            if self.inplace:  # editable installs and build_ext --inplace: the file next to the sources
                for ext in self.extensions:
                    stamps.write_stamp(os.path.join(ROOT, self.get_ext_filename(ext.name)), self._record)

        def build_extension(self, ext):
            inplace = os.path.join(ROOT, self.get_ext_filename(ext.name))
            stale = stamps.stale_because(inplace, self._record)
            if stale is None:
                print(f"{stamps.MESSAGE_PREFIX}{os.path.relpath(inplace, ROOT)} is up to date (these sources, "
                      f"torch {torch.__version__}): not compiling again", flush=True)
                target = self.get_ext_fullpath(ext.name)
                os.makedirs(os.path.dirname(target), exist_ok=True)
                if os.path.abspath(target) != os.path.abspath(inplace):
                    shutil.copy2(inplace, target)
                return
            print(f"{stamps.MESSAGE_PREFIX}compiling {len(ext.sources)} files ({stale}; "
                  f"MAX_JOBS={os.environ.get('MAX_JOBS', 'all cores')})", flush=True)
            start = time.monotonic()
            with stamps.CompileHeartbeat(ROOT, self.build_temp, len(ext.sources)):
                super().build_extension(ext)
            print(f"{stamps.MESSAGE_PREFIX}built in {stamps.duration(time.monotonic() - start)}", flush=True)

    return {"build_ext": BuildOnce}


setup(
    name="ddpx",
    version=_version(),
    description="Plugin-based PyTorch DDP training with fused gradient-compression kernels",
    long_description=open(os.path.join(ROOT, "README.md")).read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    packages=find_packages(include=["ddpx", "ddpx.*"])
    + find_packages("plugins", include=["ddpx_plugins", "ddpx_plugins.*"]),
    # plugins/ is a source root: the folder plugins/ddpx_plugins is named as it is imported
    # (its subpackages, e.g. ddpx_plugins.logging, follow from this one entry)
    package_dir={"ddpx_plugins": "plugins/ddpx_plugins"},
    package_data={"ddpx": ["data/*.csv.gz", "config/*.yaml"]},
    ext_modules=_extensions(),
    cmdclass=_cmdclass(),
    # numpy: torch's object collectives (all_gather_object, broadcast_object_list), which
    # every run uses at start-up, need it, and the torch wheel does not require it
    # safetensors: the trained model's file (ddpx/rank/model_files.py; torch.save where it is missing)
    install_requires=["torch>=2.7", "pybind11", "ninja", "pluggy>=1.2", "pyyaml", "tqdm", "numpy", "safetensors"],
    extras_require={
        "tensorboard": ["tensorboard"],  # logging.tensorboard: true
        "wandb": ["wandb"],  # logging.wandb.project
        "mlflow": ["mlflow"],  # logging.mlflow.experiment (the full package: the tests start `mlflow server`)
        # elastic.recovery: live. The nightly of 2026-10-26: 0.2.0 (PyPI's release) crashes the survivor
        # when a peer dies inside an allreduce (docs/recovery.md).
        "ft": ["torchft-nightly==2026.10.26"],
        "examples": ["pillow"],  # examples/resnet_images without torchvision
        "test": ["pytest", "pytest-timeout", "hypothesis", "pillow", "tensorboard", "wandb", "mlflow",
                 "torchft-nightly==2026.10.26"],
    },
    # Third-party plugins join through the entry-point group "ddpx"; the built-in ones are
    # listed in ddpx/plugin/builtin.py.
    entry_points={"console_scripts": ["ddpx = ddpx.cli:main"]},
    zip_safe=False,
)
