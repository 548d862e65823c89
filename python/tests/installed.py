"""The installed wheel, checked before the torch tests run from it.

`cargo xtask test-torch` builds the wheel (`cargo xtask dist`), installs it into
a fresh venv with no cargo or rustc on PATH, and runs this script with that
venv's Python, from outside the source tree:

    python installed.py --source python/zeropp --version 0.1.0 --wheel target/dist/zeropp-...whl

Each check prints ``ok   NAME`` or ``FAIL NAME: why``; any FAIL exits 1. The
seeded defect (`cargo xtask test-torch` runs it too) installs a wheel with one
module dropped, and this script must fail on the module check.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

RESULTS: list[bool] = []


def check(name: str, ok: bool, why: str = "") -> None:
    print(f"ok   {name}" if ok else f"FAIL {name}: {why}", flush=True)
    RESULTS.append(ok)


def source_modules(source: pathlib.Path) -> list[str]:
    """The dotted names of every module of the source package `source`."""
    mods = []
    for f in sorted(source.rglob("*.py")):
        rel = f.relative_to(source.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods.append(".".join(parts))
    return mods


def import_error_of(code: str, extra_path: str | None = None) -> str:
    """The last stderr line of a Python that runs `code` (and must fail)."""
    env = dict(os.environ)
    if extra_path is not None:
        env["PYTHONPATH"] = extra_path + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tempfile.gettempdir())
    lines = [l for l in p.stderr.splitlines() if l.strip()]
    return "" if p.returncode == 0 else (lines[-1] if lines else f"exit {p.returncode} with no message")


def pep440(version: str) -> str:
    """A Cargo (SemVer) version as a wheel's metadata spells it: 1.2.3-rc.1 -> 1.2.3rc1."""
    for semver, pep in (("-alpha.", "a"), ("-beta.", "b"), ("-rc.", "rc")):
        version = version.replace(semver, pep)
    return version


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--source", required=True, help="the source tree's package folder (python/zeropp)")
    ap.add_argument("--version", required=True, help="the Cargo workspace's version")
    ap.add_argument("--wheel", required=True, help="the wheel that was installed")
    a = ap.parse_args()
    source = pathlib.Path(a.source).resolve()

    # 1. The toolchain is out of reach, so nothing below can have been built here.
    found = [t for t in ("cargo", "rustc") if shutil.which(t)]
    check("no cargo or rustc on PATH", not found, f"found {found}")

    # 2. zeropp is the installed one, from this venv, and there is only one.
    import zeropp

    where = pathlib.Path(zeropp.__file__).resolve()
    check("zeropp is imported from this venv", where.is_relative_to(pathlib.Path(sys.prefix).resolve()),
          f"{where} is not under {sys.prefix}")
    check("zeropp is not the source tree", not where.is_relative_to(source), f"{where}")
    dists = [d for d in md.distributions() if (d.metadata["Name"] or "").lower() == "zeropp"]
    check("one zeropp distribution is installed", len(dists) == 1, f"{len(dists)} found")

    # 3. Every module of the source tree is in the wheel and imports.
    installed_root = where.parent
    modules = source_modules(source)
    # The module check must have something to see: a wrong --source finds nothing.
    check("the source tree has the package and zeropp.torch", {"zeropp", "zeropp.torch"} <= set(modules),
          f"{source} gives {modules}")
    for mod in modules:
        parts = mod.split(".")[1:]
        as_pkg = installed_root.joinpath(*parts, "__init__.py")
        as_file = installed_root.joinpath(*parts[:-1], parts[-1] + ".py") if parts else as_pkg
        present = as_file.is_file() or as_pkg.is_file()
        check(f"module {mod} is in the wheel", present, f"neither {as_file} nor {as_pkg} exists")
        if present:
            try:
                importlib.import_module(mod)
                check(f"module {mod} imports", True)
            except Exception as e:  # noqa: BLE001 (the check reports any failure)
                check(f"module {mod} imports", False, f"{type(e).__name__}: {e}")

    # 4. The extension is the stable-ABI build, and no GPU binaries ride along.
    ext = pathlib.Path(zeropp._zeropp.__file__).name
    check("the extension is abi3", ext.endswith(".abi3.so"), ext)
    files = [str(f) for f in (md.files("zeropp") or [])]
    gpu = [f for f in files if f.endswith((".ptx", ".cubin", ".fatbin"))]
    check("the wheel holds no PTX or cubins", not gpu, f"{gpu}")

    # 5. One version: the crates', the wheel's metadata's and the module's
    #    (the metadata in PEP 440's spelling: 0.2.0-rc.1 is 0.2.0rc1 there).
    check("zeropp.__version__ is the crates' version", zeropp.__version__ == a.version,
          f"{zeropp.__version__} != {a.version}")
    check("the wheel's metadata has the same version", md.version("zeropp") == pep440(a.version),
          f"{md.version('zeropp')} != {pep440(a.version)}")
    check("Requires-Python is >=3.11", md.metadata("zeropp")["Requires-Python"] == ">=3.11",
          str(md.metadata("zeropp")["Requires-Python"]))

    # 6. pip refuses the wheel for a Python below 3.11, and takes it for 3.11
    #    (the control: the same command, so the refusal is the version's).
    def pip_dry_run(version: str) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory() as t:
            return subprocess.run(
                [sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", "--no-index",
                 "--disable-pip-version-check", "--only-binary=:all:", "--python-version", version,
                 "--target", t, a.wheel],
                capture_output=True, text=True)

    old, new = pip_dry_run("3.10"), pip_dry_run("3.11")
    check("pip refuses the wheel on Python 3.10", old.returncode != 0 and "not a supported wheel" in old.stderr,
          f"exit {old.returncode}: {old.stderr.strip()[-300:]}")
    check("pip takes the wheel on Python 3.11", new.returncode == 0, f"exit {new.returncode}: {new.stderr[-300:]}")

    # 7. zeropp.torch without torch, or with one below the floor: one line naming the fix.
    fix = "pip install 'torch>=2.9'"
    no_torch = import_error_of("import sys; sys.modules['torch'] = None; import zeropp.torch")
    check("import zeropp.torch without torch names the fix",
          no_torch.startswith("ImportError: zeropp.torch needs PyTorch >= 2.9") and fix in no_torch, repr(no_torch))
    with tempfile.TemporaryDirectory() as fake:
        os.makedirs(os.path.join(fake, "torch"))
        with open(os.path.join(fake, "torch", "__init__.py"), "w") as f:
            f.write('__version__ = "2.8.0+cpu"\n')
        old_torch = import_error_of("import zeropp.torch", extra_path=fake)
    check("import zeropp.torch with torch 2.8 names the fix",
          old_torch.startswith("ImportError: zeropp.torch needs PyTorch >= 2.9") and "2.8.0+cpu" in old_torch
          and fix in old_torch, repr(old_torch))
    # The control: the real torch imports (so the two refusals are the guard's).
    real = import_error_of("import zeropp.torch")
    check("import zeropp.torch with this torch works", real == "", real)

    failed = RESULTS.count(False)
    print(f"installed wheel: {len(RESULTS) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
