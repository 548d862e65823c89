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
//! and two minutes on a new machine, once; a stamp file keeps it). The wheel
//! under test goes into a fresh venv beside it (`target/wheel-floor-venv`),
//! as into the main one's.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::cmd::{root, run};

/// The floor release.
pub(crate) const FLOOR: &str = "torch==2.9.0";

/// A fresh venv holding `wheel`, beside the floor venv (made, or checked by
/// its stamp, next to the main torch venv `main`).
pub(crate) fn venv(main: &Path, wheel: &Path) -> Result<PathBuf, String> {
    let venv = crate::wheel::pinned_venv(
        &main.with_file_name("torch-floor-venv"),
        &[FLOOR, "numpy==2.2.6"],
        "the floor torch with its own dependencies (CUDA 12 wheels)",
    )?;
    let base = venv;
    let venv = crate::wheel::install(&root().join("target/wheel-floor-venv"), &base, wheel)?;
    // The step must test the floor, not whatever torch the path resolves to.
    let version = FLOOR.trim_start_matches("torch==");
    let mut c = Command::new(venv.join("bin/python"));
    c.args(["-c", &format!("import torch, sys; sys.exit(torch.__version__.split('+')[0] != '{version}')")])
        .current_dir(root().join("target"));
    run(&format!("the floor venv imports torch {version}"), c)?;
    Ok(venv)
}
