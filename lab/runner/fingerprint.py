"""Where a number was measured: lab version and commit, Python, torch/CUDA, GPU and driver, host,
and, per boot of a command engine, the engine's own version.

Read without importing torch (package metadata and torch's own version file), so taking a
fingerprint costs milliseconds and cannot initialise CUDA in the lab process. The lab's venv need
not hold the engine it boots, so `engine_version` asks the engine: its `/version` (vLLM) or
`/get_server_info` (SGLang) answer, else the command's own interpreter for the version of the
distribution that holds the `-m` module it runs (llama-cpp-python).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import re
import shutil
import socket
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import httpx
import psutil

REPO = Path(__file__).resolve().parents[2]  # lab/runner/fingerprint.py -> the checkout
# Engines and libraries whose version changes what a boot measures.
PACKAGES = ("torch", "triton", "transformers", "tokenizers", "vllm", "sglang", "llama_cpp_python", "flashinfer-python")


def collect() -> dict[str, Any]:
    commit, dirty = _git()
    return {
        "lab_version": _lab_version(),
        "git_commit": commit,
        "git_dirty": dirty,
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "packages": {name: version for name in PACKAGES if (version := _version(name))},
        "cuda": _torch_cuda(),
        "gpus": _gpus(),
        "host": socket.gethostname(),
        "os": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "mem_total": psutil.virtual_memory().total,
    }


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _lab_version() -> str | None:
    version = _version("lab")
    if version is None and (REPO / "pyproject.toml").exists():  # running from a checkout, not installed
        version = tomllib.loads((REPO / "pyproject.toml").read_text()).get("project", {}).get("version")
    return version


def _git() -> tuple[str | None, bool | None]:
    if shutil.which("git") is None or not (REPO / ".git").exists():
        return None, None
    try:
        commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        status = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None, None
    return commit, bool(status.strip())


def _torch_cuda() -> str | None:
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    version_file = Path(next(iter(spec.submodule_search_locations))) / "version.py"
    try:
        match = re.search(r"^cuda\s*(?::[^=]*)?=\s*['\"]([^'\"]+)['\"]", version_file.read_text(), re.M)
    except OSError:
        return None
    return match.group(1) if match else None


def _gpus() -> list[dict[str, str]]:
    if shutil.which("nvidia-smi") is None:
        return []
    query = "name,driver_version,memory.total,clocks.max.sm,power.limit"
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    keys = query.split(",")
    return [dict(zip(keys, (v.strip() for v in line.split(",")))) for line in out.splitlines() if line.strip()]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


# Run by the engine command's own interpreter: the version of the distribution holding module argv[1].
_DIST_VERSION = ("import importlib.metadata as m, sys; top = sys.argv[1].split('.')[0]; "
                 "dist = (m.packages_distributions().get(top) or [top])[0]; print(dist, m.version(dist))")


def engine_version(argv: list[str], base_url: str) -> dict[str, str] | None:
    """{"name", "version", "source"} of a booted command engine, or None when nothing says."""
    for route in ("/version", "/get_server_info"):
        try:
            answer = httpx.get(f"{base_url}{route}", timeout=10)
            version = answer.json().get("version") if answer.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError):
            version = None
        if isinstance(version, str):
            return {"name": argv[0], "version": version, "source": f"GET {route}"}
    if len(argv) >= 3 and argv[1] == "-m" and "python" in Path(argv[0]).name:
        try:
            out = subprocess.run([argv[0], "-c", _DIST_VERSION, argv[2]], capture_output=True, text=True,
                                 timeout=60, check=True).stdout.split()
        except (OSError, subprocess.SubprocessError):
            return None
        if len(out) == 2:
            return {"name": out[0], "version": out[1], "source": f"{argv[0]}'s package metadata"}
    return None
