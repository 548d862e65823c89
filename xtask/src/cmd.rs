//! What every task uses: the workspace root, `cargo`, one step of a task,
//! whether this is CI, the MPI features and launcher, the machine. It uses no
//! other module of xtask, so every task can use it.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The workspace root (`xtask/` sits directly under it).
pub(crate) fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

/// `cargo` (the one running this task, else the one on PATH) in the workspace root.
pub(crate) fn cargo() -> Command {
    let mut c = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    c.current_dir(root());
    c
}

/// Runs one step of a task: prints the command, then its wall time; an error
/// when it cannot start or fails.
pub(crate) fn run(step: &str, mut cmd: Command) -> Result<(), String> {
    eprintln!("\n==> {step}: {cmd:?}");
    let started = std::time::Instant::now();
    let status = cmd.status().map_err(|e| format!("{step}: could not start: {e}"))?;
    // Each step's wall time, so a slow CI run says where its minutes went.
    eprintln!("<== {step}: {:.0} s", started.elapsed().as_secs_f64());
    if status.success() { Ok(()) } else { Err(format!("{step} failed ({status})")) }
}

/// Whether this runs under CI (`CI=true`), where a step that would skip fails.
pub(crate) fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}

/// The features of an MPI build of the stack (the CLI, the candle example and
/// comm's MPI programs), the same everywhere it is built so that the builds share
/// their artefacts: `ci`'s tests, `xtask/mpi-tests.sh` and the cluster test.
pub(crate) const MPI_FEATURES: &str = "zeropp-comm/mpi,zeropp/mpi,zeropp-candle/mpi";

/// The MPI suite's build of the CLI and its programs, xtask/mpi-tests.sh's to
/// the letter (`--workspace`: the features resolve as for `cargo test
/// --workspace`, whose artefacts `ci` reuses; the examples pull the same
/// dev-dependencies, so a later build of these targets rebuilds nothing).
pub(crate) fn mpi_suite_build(profile: &str) -> Command {
    let mut c = cargo();
    c.args(["build", "--locked", "--workspace", "--profile", profile])
        .args(["--features", MPI_FEATURES])
        .args(["--example", "mpi_conformance", "--example", "mpi_fault", "--example", "train_your_model"])
        .args(["--bin", "zeropp"]);
    c
}

/// Whether OpenMPI's `mpirun` is on PATH.
pub(crate) fn has_mpirun() -> bool {
    Command::new("mpirun").arg("--version").output().map(|o| o.status.success()).unwrap_or(false)
}

/// This machine's CPU and hardware threads, for a bench report's header.
pub(crate) fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    format!("{cpu}, {threads} hardware threads")
}
