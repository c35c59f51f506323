"""Builds bmtwrap._C, one extension module file in the bmtwrap package, from csrc/ with pybind11:
`pip install --no-build-isolation -e .` or `python setup.py build_ext --inplace` (add --force after changing
the environment). CPU kernels always; CUDA kernels whenever nvcc is found. Nothing links against torch (see
csrc/common.h), so a torch upgrade needs no rebuild. Environment, read here only:
    BMTWRAP_NO_CUDA=1     build the CPU kernels only, even where nvcc exists
    BMTWRAP_CUDA_ARCH     compute capabilities, e.g. "90" (default "80;90"); the highest also ships as PTX
    CUDA_HOME, CUDA_PATH  searched for bin/nvcc before PATH
    BMTWRAP_BUILD_JOBS    sources compiled at once (default: one per CPU core)
"""

import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import find_packages, setup


def build_jobs() -> int:
    value = os.environ.get("BMTWRAP_BUILD_JOBS", "0")
    if not value.isdigit():
        raise SystemExit(f"BMTWRAP_BUILD_JOBS={value!r}: expected a number of jobs (0: one per CPU core)")
    return int(value) or os.cpu_count() or 1


# The C++ sources compile side by side (pybind11's helper), as do the CUDA ones below: on two cores the build
# took 70 s one source at a time, 46 s so.
JOBS = build_jobs()
ParallelCompile(default=JOBS).install()

CPP_SOURCES = ["csrc/bind.cpp", *sorted(p.as_posix() for p in Path("csrc/cpu").glob("*.cpp"))]
CUDA_SOURCES = sorted(p.as_posix() for p in Path("csrc/cuda").glob("*.cu"))
HEADERS = sorted(p.as_posix() for p in Path("csrc").rglob("*.h"))


def find_nvcc() -> str | None:
    if os.environ.get("BMTWRAP_NO_CUDA", "0") not in ("", "0"):
        return None
    homes = [os.environ[var] for var in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(var)]
    candidates = [os.path.join(home, "bin", "nvcc") for home in homes] + [shutil.which("nvcc")]
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


def cuda_archs() -> list[str]:
    spec = os.environ.get("BMTWRAP_CUDA_ARCH", "80;90")
    archs = [a.replace(".", "") for a in re.split(r"[;,\s]+", spec) if a]
    if not archs or not all(re.fullmatch(r"\d+[af]?", a) for a in archs):
        raise SystemExit(f"BMTWRAP_CUDA_ARCH={spec!r}: expected compute capabilities such as '80;90' or '9.0'")
    return archs


def cuda_arch_flags(archs: list[str]) -> list[str]:
    # PTX of the highest plain arch lets GPUs newer than every listed arch JIT the kernels.
    top = max((int(a) for a in archs if a.isdigit()), default=None)
    ptx = [f"-gencode=arch=compute_{top},code=compute_{top}"] if top else []
    return [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs] + ptx


def cuda_library_dirs(nvcc: str) -> list[str]:
    # From nvcc's own link step (its dry run): nvcc may be a wrapper script, so its path says nothing.
    dry = subprocess.run([nvcc, "--dryrun", "-x", "cu", "-c", os.devnull, "-o", os.devnull],
                         capture_output=True, text=True, check=False)
    lines = [line for line in (dry.stdout + dry.stderr).splitlines() if "LIBRARIES=" in line]
    dirs = [d for line in lines for d in re.findall(r'-L"?([^"\s]+)', line) if not d.rstrip("/").endswith("stubs")]
    if not dirs:
        raise SystemExit(f"could not find the CUDA libraries of {nvcc}; set BMTWRAP_NO_CUDA=1 to build without CUDA")
    return dirs


class BuildExt(build_ext):
    """pybind11's build_ext, plus csrc/cuda/*.cu compiled by nvcc into objects linked into the extension."""

    def build_extension(self, ext: Pybind11Extension) -> None:
        nvcc = find_nvcc()
        print(f"bmtwrap._C: CUDA kernels {'built with ' + nvcc if nvcc else 'skipped (no nvcc, or BMTWRAP_NO_CUDA)'}")
        if nvcc and CUDA_SOURCES:
            archs = cuda_archs()
            # The module reports the architectures (bmtwrap.ops.cuda_archs()), as compiled into its objects.
            ext.define_macros += [("BMTWRAP_WITH_CUDA", "1"), ("BMTWRAP_CUDA_ARCHS", f'"{";".join(archs)}"')]
            with ThreadPoolExecutor(max_workers=min(JOBS, len(CUDA_SOURCES))) as pool:
                ext.extra_objects.extend(pool.map(lambda source: self.compile_cuda(nvcc, source, archs), CUDA_SOURCES))
            ext.library_dirs.extend(cuda_library_dirs(nvcc))
            # Static cudart: no libcudart.so to find at run time (torch's copy may be another version or in a
            # pip wheel), and the module imports on machines without a driver. --exclude-libs keeps its
            # symbols private, so our calls never bind to the libcudart.so torch loads globally.
            ext.libraries.extend(["cudart_static", "rt", "dl"])
            ext.extra_link_args.append("-Wl,--exclude-libs,libcudart_static.a")
        super().build_extension(ext)

    def compile_cuda(self, nvcc: str, source: str, archs: list[str]) -> str:
        obj = os.path.join(self.build_temp, Path(source).with_suffix(".o"))
        mtime = os.path.getmtime(obj) if os.path.exists(obj) else -1.0
        if self.force or any(os.path.getmtime(dep) > mtime for dep in [source, *HEADERS]):
            os.makedirs(os.path.dirname(obj), exist_ok=True)
            cmd = [nvcc, "-O3", "-std=c++17", "-Icsrc", "-Xcompiler", "-fPIC,-fvisibility=hidden",
                   "--threads", "0", *cuda_arch_flags(archs), "-c", source, "-o", obj]
            print(" ".join(cmd))
            if subprocess.run(cmd, check=False).returncode != 0:
                raise SystemExit(f"nvcc failed on {source}; set BMTWRAP_NO_CUDA=1 to build the CPU kernels only")
        return obj


extension = Pybind11Extension(  # a single module file, bmtwrap/_C.<abi>.so
    "bmtwrap._C",
    CPP_SOURCES,
    include_dirs=["csrc"],
    depends=[*CUDA_SOURCES, *HEADERS],
    cxx_std=17,
    # -ffp-contract=off: the compiler must not fuse a*b+c on its own (GCC does by default in C++, and inside
    # functions built for FMA targets), or results would depend on the ISA path; kernels that want an FMA
    # call it explicitly. See [Note: matching torch bit for bit] in csrc/cpu/adam.cpp.
    extra_compile_args=["-O3", "-pthread", "-ffp-contract=off"],
    extra_link_args=["-pthread"],
)

setup(
    packages=find_packages(include=["bmtwrap*"]),
    ext_modules=[extension],
    cmdclass={"build_ext": BuildExt},
)
