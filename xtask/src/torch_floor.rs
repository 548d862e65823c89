//! The oldest torch zeropp.torch supports, tested: `cargo xtask test-torch`'s
//! floor steps.
//!
//! FSDP2's custom collectives (`FSDPModule.set_custom_all_gather` and
//! `set_custom_reduce_scatter`, pytorch#155189) first shipped in torch 2.9.0;
//! 2.8.0 has neither (its `_fully_shard.py` was read for this). So
//! `python/pyproject.toml` asks for `torch>=2.9`, and the floor steps run the
//! collective test (test 2) and the contract test (5a) on exactly 2.9.0, while
//! the main venv holds the latest release (2.15.0).
//!
//! The floor venv (`torch-floor-venv` beside the main one) has its own
//! dependencies: 2.9.0's CUDA 12 wheels are not 2.15.0's CUDA 13 ones, and
//! torch will not import without the ones it was built against (about 3 GB
//! and two minutes on a new machine, once; a stamp file keeps it).

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::{root, run};

/// The floor release.
pub(crate) const FLOOR: &str = "torch==2.9.0";

/// The floor venv, made (or checked by its stamp) beside the main venv
/// `main`, with the package installed from this checkout (built with the
/// main venv's maturin).
pub(crate) fn venv(main: &Path) -> Result<PathBuf, String> {
    let venv = main.with_file_name("torch-floor-venv");
    let stamp = venv.join("zeropp-pins.txt");
    let pins = [FLOOR, "numpy==2.2.6", "maturin==1.9.4"];
    let want = pins.join("\n");
    if !(venv.join("bin/python").is_file() && std::fs::read_to_string(&stamp).is_ok_and(|s| s == want)) {
        let mut c = Command::new("python3");
        c.args(["-m", "venv", "--clear"]).arg(&venv);
        run("floor venv", c)?;
        let mut c = Command::new(venv.join("bin/pip"));
        c.args(["install", "--quiet", "--disable-pip-version-check"]).args(pins);
        run("pip install the floor torch with its own dependencies (CUDA 12 wheels)", c)?;
        std::fs::write(&stamp, want).map_err(|e| format!("{}: {e}", stamp.display()))?;
    }
    let mut c = Command::new(venv.join("bin/pip"));
    c.args(["install", "--quiet", "--disable-pip-version-check", "--no-build-isolation", "--no-deps"])
        .arg("--force-reinstall")
        .arg(root().join("python"))
        .current_dir(root())
        .env("PATH", path_with(&main.join("bin")));
    run("pip install ./python into the floor venv", c)?;
    // The step must test the floor, not whatever torch the path resolves to.
    let version = FLOOR.trim_start_matches("torch==");
    let mut c = Command::new(venv.join("bin/python"));
    c.args(["-c", &format!("import torch, sys; sys.exit(torch.__version__.split('+')[0] != '{version}')")])
        .current_dir(root().join("target"));
    run(&format!("the floor venv imports torch {version}"), c)?;
    Ok(venv)
}

/// `PATH` with `dir` in front.
pub(crate) fn path_with(dir: &Path) -> std::ffi::OsString {
    let mut parts = vec![dir.to_path_buf()];
    if let Some(p) = std::env::var_os("PATH") {
        parts.extend(std::env::split_paths(&p));
    }
    std::env::join_paths(parts).unwrap_or_default()
}
