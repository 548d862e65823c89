//! The `cuda` feature's tasks: `cargo xtask gpu test`, `cargo xtask bench gpu`,
//! and the CI steps (artefact freshness, clippy, build, GPU tests that skip).
//!
//! Every cargo command built with `--features cuda` gets `CUDA_LIBRARY_PATH`
//! pointing at the stub driver from [`crate::ptx::stub`], so it links on a
//! machine without CUDA; on a machine with a driver the real `libcuda.so.1` is
//! used at run time.

use std::path::Path;
use std::process::Command;

use crate::cmd::run;
use crate::ptx;
use crate::ptx::cuda_cargo;

/// `cargo xtask gpu <test|clippy|ci>`.
pub(crate) fn gpu(args: &[String]) -> Result<(), String> {
    match args.first().map(String::as_str) {
        Some("test") => test(),
        Some("clippy") => clippy(),
        Some("ci") => ci(),
        Some("nccl") => nccl_mpi(),
        Some("check") => crate::gpu_check::check(&args[1..]),
        Some("verdict") => crate::gpu_check::verdict(),
        _ => Err("usage: cargo xtask gpu test | clippy | ci | nccl | check [--pack-only] | verdict".into()),
    }
}

/// The GPU tests (modules `gpu` and `gpu_emu` of zeropp-quant's test binary).
/// `gpu` needs a device: without one it skips with one counted line, and with
/// `ZEROPP_REQUIRE_GPU=1` a missing device fails. `gpu_emu` runs the kernels'
/// source on the CPU through the emulator built here, so it runs everywhere.
pub(crate) fn test() -> Result<(), String> {
    let emulator = emulator()?;
    let mut t = cuda_cargo()?;
    t.args(["test", "--locked", "-p", "zeropp-quant", "--features", "cuda", "--test", "it", "--", "gpu"])
        .env("ZEROPP_CUDA_EMULATOR", emulator);
    run("GPU tests (zeropp-quant --features cuda)", t)?;
    let mut c = cuda_cargo()?;
    c.args(["test", "--locked", "-p", "zeropp-comm", "--features", "nccl", "--test", "it", "--", "device_"]);
    run("GPU tests (zeropp-comm --features nccl: the one-GPU cluster, NCCL with one rank)", c)?;
    let mut u = cuda_cargo()?;
    u.args(["test", "--locked", "-p", "zeropp-comm", "--features", "nccl", "--lib", "--", "device::"]);
    run("unit tests of the device backends (zeropp-comm --features nccl)", u)?;
    eprintln!(
        "==> device: {}",
        if ptx::has_driver() { "a CUDA driver is installed" } else { "no CUDA driver (stub libcuda)" }
    );
    Ok(())
}

/// Builds `cuda/emulate.cpp` (the kernels' source run on the CPU, for the
/// `gpu_emu` tests) into `target/cuda/zq-emulate`.
fn emulator() -> Result<std::path::PathBuf, String> {
    let dir = crate::cmd::root().join("target/cuda");
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let exe = dir.join("zq-emulate");
    let mut gxx = Command::new("g++");
    gxx.args([
        "-std=c++20",
        "-O2",
        "-ffp-contract=off",
        "-U_FORTIFY_SOURCE",
        "-Wall",
        "-Wextra",
        "-Werror",
        "-o",
    ])
    .arg(&exe)
    .arg(crate::cmd::root().join("crates/zeropp-quant/cuda/emulate.cpp"));
    run("g++ kernel emulator", gxx)?;
    Ok(exe)
}

fn clippy() -> Result<(), String> {
    let mut c = cuda_cargo()?;
    c.args([
        "clippy",
        "--locked",
        "-p",
        "zeropp-quant",
        "-p",
        "zeropp-comm",
        "--features",
        // `nccl` implies `cuda`; with `mpi`, the `nccl_mpi` example builds too.
        "zeropp-quant/cuda,zeropp-comm/nccl,zeropp-comm/mpi",
        "--all-targets",
        "--",
        "-D",
        "warnings",
    ]);
    run("clippy (zeropp-quant and zeropp-comm, cuda feature)", c)
}

/// CI's share, after CI's one clippy and rustdoc run (which include the GPU
/// features, `crate::ci::GPU_FEATURES`): the artefacts are current, and the GPU
/// tests build, link (stub) and run (skipping without a GPU).
pub(crate) fn ci() -> Result<(), String> {
    ptx::ptx(&["--check".to_string()])?;
    test()?;
    // The GPU check's verdict, proved both ways on this machine (no GPU needed).
    crate::gpu_check::verdict()
}

/// `cargo xtask bench gpu`: the GPU bench (`benches/gpu.rs`) writes
/// `target/bench-report/gpu.md` itself (ratios to a device-to-device memcpy of
/// the same input bytes, measured in the same run). Without a device it says so
/// and writes nothing; with `ZEROPP_REQUIRE_GPU=1` that is a failure.
pub(crate) fn bench(report_dir: &Path) -> Result<(), String> {
    cuda_bench(&report_dir.join("gpu.md"), "zeropp-quant", "gpu", "ZEROPP_GPU_BENCH_OUT")
}

/// Runs bench `bench` of `package` with feature `cuda`, which writes its report
/// to `out` (named in the environment variable `out_env`) when it has something to say.
fn cuda_bench(out: &Path, package: &str, bench: &str, out_env: &str) -> Result<(), String> {
    let _ = std::fs::remove_file(out);
    let mut c = cuda_cargo()?;
    c.args(["bench", "--locked", "-p", package, "--features", "cuda", "--bench", bench]).env(out_env, out);
    run(&format!("bench {}", bench.replace('_', "-")), c)?;
    if out.exists() {
        eprintln!("==> wrote {}", out.display());
    }
    Ok(())
}

/// `cargo xtask bench gpu-comm`: the device collectives' bench
/// (zeropp-comm `benches/gpu_comm.rs`, feature `cuda`): qgZ / bf16 reduce-scatter,
/// qwZ / bf16 all-gather and the quantization share of each, on the host-simulated
/// device always and on the GPU when there is one (without one it says so;
/// `ZEROPP_REQUIRE_GPU=1` makes that a failure). Writes
/// `target/bench-report/gpu-comm.md`.
pub(crate) fn bench_comm(report_dir: &Path) -> Result<(), String> {
    cuda_bench(&report_dir.join("gpu-comm.md"), "zeropp-comm", "gpu_comm", "ZEROPP_GPU_COMM_BENCH_OUT")
}

/// GPUs the driver shows (`nvidia-smi -L`, one line per GPU); 0 without it.
fn installed_gpus() -> usize {
    Command::new("nvidia-smi")
        .arg("-L")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map_or(0, |o| String::from_utf8_lossy(&o.stdout).lines().filter(|l| l.starts_with("GPU ")).count())
}

/// The GPUs this job may use: those an inherited `CUDA_VISIBLE_DEVICES` lists
/// (a scheduler's assignment; at most the installed ones), else all installed.
fn visible_gpus(cuda_visible_devices: Option<&str>, installed: usize) -> usize {
    match cuda_visible_devices.map(str::trim) {
        Some(list) => list.split(',').filter(|d| !d.trim().is_empty()).count().min(installed),
        None => installed,
    }
}

/// `cargo xtask gpu nccl`: NCCL across GPUs under `mpirun`, the `nccl_mpi`
/// example (zeropp-comm, features `nccl` + `mpi`), one process per visible GPU
/// (at most 8). The processes inherit `CUDA_VISIBLE_DEVICES` as it is (a
/// scheduler's assignment stays in force) and each takes the visible device
/// of its node-local rank. With fewer than two GPUs it prints one counted skip
/// line; `ZEROPP_REQUIRE_MULTI_GPU=1` makes that a failure.
pub(crate) fn nccl_mpi() -> Result<(), String> {
    let inherited = std::env::var("CUDA_VISIBLE_DEVICES").ok();
    let gpus = visible_gpus(inherited.as_deref(), installed_gpus());
    if gpus < 2 {
        let required = std::env::var("ZEROPP_REQUIRE_MULTI_GPU").is_ok_and(|v| v.trim() == "1");
        let line = format!("nccl-mpi: 1 test skipped: {gpus} GPU(s) visible, NCCL across processes needs 2");
        if required {
            return Err(format!("{line} (ZEROPP_REQUIRE_MULTI_GPU=1)"));
        }
        eprintln!("{line}");
        return Ok(());
    }
    let mut b = cuda_cargo()?;
    b.args([
        "build",
        "--locked",
        "--release",
        "-p",
        "zeropp-comm",
        "--features",
        "nccl,mpi",
        "--example",
        "nccl_mpi",
    ]);
    run("build nccl_mpi", b)?;
    let exe = crate::cmd::root().join("target/release/examples/nccl_mpi");
    let np = gpus.min(8).to_string();
    let mut m = Command::new("timeout");
    m.args(["300", "mpirun", "-np", &np, "-x", "ZEROPP_REQUIRE_GPU=1"]);
    if inherited.is_some() {
        m.args(["-x", "CUDA_VISIBLE_DEVICES"]);
    }
    m.arg(&exe).env("OMPI_ALLOW_RUN_AS_ROOT", "1").env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
    run(&format!("NCCL under mpirun on {np} GPUs"), m)
}

#[cfg(test)]
mod tests {
    use super::visible_gpus;

    /// An inherited `CUDA_VISIBLE_DEVICES` decides how many GPUs the job uses.
    #[test]
    fn an_inherited_device_list_is_respected() {
        assert_eq!(visible_gpus(None, 8), 8);
        assert_eq!(visible_gpus(Some("2,5"), 8), 2);
        assert_eq!(visible_gpus(Some(" 3 "), 8), 1);
        assert_eq!(visible_gpus(Some(""), 8), 0);
        assert_eq!(visible_gpus(Some("0,1,2,3"), 2), 2);
    }
}
