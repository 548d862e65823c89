//! `cargo xtask ci` (the README's test command) and the test tasks it runs:
//! `test` (the workspace's tests) and `test-mpi` (`xtask/mpi-tests.sh`); the
//! others it calls live with their subjects (`torch`, `dist`, `package`).

use std::process::Command;

use crate::cmd::{MPI_FEATURES, cargo, has_mpirun, root, run};
use crate::{cluster, dist, gpu, package, torch};

pub(crate) fn ci(args: &[String]) -> Result<(), String> {
    let no_mpi = args.iter().any(|a| a == "--no-mpi");
    // The torch venv (test-torch, last) installs while the Rust side builds.
    let venv = torch::VenvJob::start();
    let mut fmt = cargo();
    fmt.args(["fmt", "--all", "--", "--check"]);
    run("rustfmt", fmt)?;

    // No file uses a file that is not below it (xtask/circles.py says how a
    // use is counted); its self-test seeds two circles and must find both.
    for args in [&["xtask/circles.py", "--self-test"][..], &["xtask/circles.py"][..]] {
        let mut c = Command::new("python3");
        c.args(args).current_dir(root());
        run("file circles", c)?;
    }

    // With MPI, clippy and the workspace's tests run once, with the `mpi`
    // feature: the features only add code (no item is compiled only without
    // them), so one clippy run lints everything, and the MPI suite's programs
    // (built `--workspace` in the same profile, below) and comm's `mpi::` unit
    // tests come from the tests' artefacts instead of a second build of the
    // whole stack (about 4 of CI's minutes; the second clippy run was 30 s).
    let mpi = !no_mpi && has_mpirun() && mpi_backend_exists();
    // The GPU features join too (`cuda`, `nccl`: the CUDA device and NCCL code
    // of quant and comm, checked against the stub driver), so this one run is
    // also the GPU code's clippy (it was a separate 80 s run).
    let features = all_features(mpi);
    let mut clippy = crate::ptx::cuda_cargo()?;
    clippy.args(["clippy", "--workspace", "--all-targets", "--locked", "--features", &features]);
    clippy.args(["--", "-D", "warnings"]);
    run(&format!("clippy ({features})"), clippy)?;

    if mpi {
        test_with(Some(MPI_FEATURES))?;
    } else {
        test()?;
    }

    let mut doc = crate::ptx::cuda_cargo()?;
    doc.args(["doc", "--workspace", "--no-deps", "--locked", "--features", &features])
        .env("RUSTDOCFLAGS", "-D warnings");
    run(&format!("rustdoc ({features})"), doc)?;

    gpu::ci()?;

    if no_mpi {
        eprintln!("\n==> MPI tests skipped (--no-mpi)");
    } else if mpi {
        test_mpi_with(&[("ZEROPP_MPI_PROFILE", "test"), ("ZEROPP_MPI_UNIT_TESTS_RAN", "1")])?;
    } else {
        eprintln!("\n==> MPI tests skipped: no `mpirun` on PATH (install libopenmpi-dev openmpi-bin)");
    }
    if !no_mpi {
        // Skips (one counted line) without root/netns/mpirun; fails instead under CI=true.
        cluster::test(&["--profile".into(), if mpi { "test" } else { "dev" }.into()])?;
    }
    // The release workflow is only run on a tag: lint it on every change.
    dist::lint_workflows()?;
    // Skips without a torch venv; fails instead under CI=true. Every Python
    // test runs from the manylinux wheel, installed without cargo.
    venv.wait();
    torch::test(&[])?;
    // Last: the published crates from their tarballs (it reuses the tests'
    // dependency builds).
    let features: Vec<String> = if mpi { vec!["--features".into(), MPI_FEATURES.into()] } else { Vec::new() };
    package::check(&features)?;
    eprintln!("\nxtask ci: all green");
    Ok(())
}

fn mpi_backend_exists() -> bool {
    root().join("crates/zeropp-comm/src/mpi").exists()
        || root().join("crates/zeropp-comm/src/mpi.rs").exists()
}

/// The features of the GPU code (quant's and comm's CUDA device, comm's NCCL),
/// which build and lint without a GPU or a CUDA toolkit against the stub driver
/// (`crate::ptx::cuda_cargo`).
pub(crate) const GPU_FEATURES: &str = "zeropp-quant/cuda,zeropp-comm/nccl";

/// Every feature CI lints and documents at once: the GPU features, and the MPI
/// features when the MPI backend builds here. No item is compiled only without
/// a feature (the two `not(feature)` items are compiled in both builds or only
/// silence a lint), so one run covers every build's code.
fn all_features(mpi: bool) -> String {
    if mpi { format!("{MPI_FEATURES},{GPU_FEATURES}") } else { GPU_FEATURES.to_string() }
}

pub(crate) fn test() -> Result<(), String> {
    test_with(None)
}

/// The workspace's tests, with `features` when given.
fn test_with(features: Option<&str>) -> Result<(), String> {
    let mut t = cargo();
    t.args(["test", "--workspace", "--locked"]);
    if let Some(f) = features {
        t.args(["--features", f]);
    }
    run(if features.is_some() { "tests (mpi feature)" } else { "tests" }, t)
}

pub(crate) fn test_mpi() -> Result<(), String> {
    test_mpi_with(&[])
}

/// `xtask/mpi-tests.sh` with `env` (`ZEROPP_MPI_PROFILE`: the cargo profile of
/// its build; `ZEROPP_MPI_UNIT_TESTS_RAN=1`: comm's `mpi::` unit tests already
/// ran in this job's workspace tests).
fn test_mpi_with(env: &[(&str, &str)]) -> Result<(), String> {
    if !has_mpirun() {
        return Err(
            "`mpirun` not found: install OpenMPI (apt-get install libopenmpi-dev openmpi-bin libclang-dev)"
                .into(),
        );
    }
    let script = root().join("xtask/mpi-tests.sh");
    if !script.exists() {
        return Err(format!("{} is missing", script.display()));
    }
    let mut c = Command::new("bash");
    c.arg(script).current_dir(root()).envs(env.iter().copied());
    run("mpi tests", c)
}
