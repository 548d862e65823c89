//! `cargo xtask gpu check`: one command for the first run on a GPU.
//!
//! A device machine may have no cargo, so the work is split in two:
//!
//! - **pack** (here, on a CPU machine): builds the GPU test and bench binaries
//!   (release, no debug info, stripped, linked against the stub driver like
//!   every `cuda` build) in their own target folder, and writes one folder to
//!   carry, `target/gpu-check/`: `bin/` (`quant-it`, `comm-it`, `bench-gpu`,
//!   `bench-gpu-comm`), `run.sh` (from `xtask/gpu-check.sh`) and `BUILD` (the
//!   commit and the date).
//! - **run** (on the device, or here as a rehearsal): `bash target/gpu-check/run.sh`
//!   runs the kernel tests, the device collectives on `CudaDevice`, `NcclComm`
//!   at world 1, `bench gpu` and `bench gpu-comm`, in that order within 8
//!   minutes, and writes `gpu-check-report.md`: each step's result, the bench
//!   tables, the device and driver, and the first failure with its CUDA error.
//!   Without a device the verdict is "no device".
//!
//! `cargo xtask gpu verdict` (run by `cargo xtask ci`) proves the script's
//! verdict on this machine, with no GPU: a fake `nvidia-smi` that lists a GPU,
//! with the stub driver, must give FAIL naming `cuInit`; a device node and no
//! `nvidia-smi` must give FAIL; neither must give NO DEVICE. So a broken GPU can
//! never pass as a machine without one.
//!
//! `cargo xtask gpu check` packs and then runs the folder here (the rehearsal);
//! `--pack-only` stops after packing. With the device tool, carry
//! `target/gpu-check` and run `bash target/gpu-check/run.sh` there.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

use crate::cmd::{root, run};
use crate::ptx::cuda_cargo;

/// The binaries of the check: (name in `bin/`, cargo arguments that build it).
const BINARIES: &[(&str, &[&str])] = &[
    ("quant-it", &["test", "-p", "zeropp-quant", "--features", "cuda", "--test", "it", "--release"]),
    ("comm-it", &["test", "-p", "zeropp-comm", "--features", "nccl", "--test", "it", "--release"]),
    ("bench-gpu", &["bench", "-p", "zeropp-quant", "--features", "cuda", "--bench", "gpu"]),
    ("bench-gpu-comm", &["bench", "-p", "zeropp-comm", "--features", "cuda", "--bench", "gpu_comm"]),
];

/// `cargo xtask gpu check [--pack-only]`.
pub(crate) fn check(args: &[String]) -> Result<(), String> {
    let dir = pack()?;
    if args.iter().any(|a| a == "--pack-only") {
        eprintln!("==> carry {} and run `bash {}/run.sh` on the device", dir.display(), dir.display());
        return Ok(());
    }
    let report = dir.join("gpu-check-report.md");
    let mut c = Command::new("bash");
    c.arg(dir.join("run.sh")).arg(&report);
    // The rehearsal runs against the stub driver when there is no real one.
    if !crate::ptx::has_driver() {
        let lib64 = crate::ptx::stub()?.join("lib64");
        c.env("LD_LIBRARY_PATH", lib64);
    }
    let result = run("gpu check (the device run, here)", c);
    match std::fs::read_to_string(&report) {
        Ok(md) => eprintln!("\n{}", md.lines().take(20).collect::<Vec<_>>().join("\n")),
        Err(e) => return Err(format!("no report at {}: {e}", report.display())),
    }
    result
}

/// Builds the binaries and writes `target/gpu-check/`; returns that folder.
fn pack() -> Result<PathBuf, String> {
    let dir = root().join("target/gpu-check");
    let bin = dir.join("bin");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&bin).map_err(|e| format!("{}: {e}", bin.display()))?;
    for (name, args) in BINARIES {
        let exe = build(args)?;
        let to = bin.join(name);
        std::fs::copy(&exe, &to).map_err(|e| format!("copy {} to {}: {e}", exe.display(), to.display()))?;
    }
    let script = dir.join("run.sh");
    std::fs::copy(root().join("xtask/gpu-check.sh"), &script)
        .map_err(|e| format!("{}: {e}", script.display()))?;
    let commit = Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .current_dir(root())
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map_or_else(|| "unknown".to_string(), |o| String::from_utf8_lossy(&o.stdout).trim().to_string());
    let date = Command::new("date")
        .args(["-u", "+%Y-%m-%dT%H:%M:%SZ"])
        .output()
        .map_or_else(|_| "unknown".to_string(), |o| String::from_utf8_lossy(&o.stdout).trim().to_string());
    std::fs::write(dir.join("BUILD"), format!("commit {commit}, packed {date}\n"))
        .map_err(|e| format!("{}: {e}", dir.display()))?;
    let bytes: u64 = std::fs::read_dir(&bin)
        .map_err(|e| format!("{}: {e}", bin.display()))?
        .flatten()
        .filter_map(|e| e.metadata().ok())
        .map(|m| m.len())
        .sum();
    eprintln!("==> packed {} ({:.1} MiB of binaries)", dir.display(), bytes as f64 / (1u64 << 20) as f64);
    Ok(dir)
}

/// Builds one binary (`--no-run`) and returns its path, from cargo's JSON messages.
fn build(args: &[&str]) -> Result<PathBuf, String> {
    let mut c = cuda_cargo()?;
    c.args(args).args(["--locked", "--no-run", "--message-format=json-render-diagnostics"]);
    // Their own target folder: the profile overrides below would otherwise
    // rebuild the workspace's usual release artefacts.
    c.env("CARGO_TARGET_DIR", root().join("target/gpu-check-build"));
    for profile in ["RELEASE", "BENCH"] {
        c.env(format!("CARGO_PROFILE_{profile}_DEBUG"), "false");
        c.env(format!("CARGO_PROFILE_{profile}_STRIP"), "symbols");
    }
    eprintln!("\n==> build for the GPU check: cargo {}", args.join(" "));
    let out = c.output().map_err(|e| format!("cargo: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "building `cargo {}` failed:\n{}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    executable(&String::from_utf8_lossy(&out.stdout))
        .ok_or_else(|| format!("cargo {} built no executable", args.join(" ")))
}

/// `cargo xtask gpu verdict`: runs `xtask/gpu-check.sh` on this machine's real
/// test binaries (the debug builds `cargo xtask gpu test` makes, linked against
/// the stub driver) in three staged machines, and checks the verdict of each:
///
/// | machine | expected |
/// |---|---|
/// | a fake `nvidia-smi -L` lists a GPU; the stub libcuda loads | FAIL, the kernel tests failing at `cuInit` |
/// | no GPU listed; the device node exists | FAIL |
/// | no GPU listed; no device node | NO DEVICE (exit 0) |
///
/// The bench binaries are left out of the pack on purpose: the first case
/// asserts that the kernel tests' own row fails, so a missing bench cannot be
/// what makes it pass.
pub(crate) fn verdict() -> Result<(), String> {
    let dir = root().join("target/gpu-verdict");
    let _ = std::fs::remove_dir_all(&dir);
    let bin = dir.join("bin");
    let fake = dir.join("fake-bin");
    for d in [&bin, &fake] {
        std::fs::create_dir_all(d).map_err(|e| format!("{}: {e}", d.display()))?;
    }
    for (name, args) in [
        ("quant-it", ["test", "-p", "zeropp-quant", "--features", "cuda", "--test", "it"]),
        ("comm-it", ["test", "-p", "zeropp-comm", "--features", "nccl", "--test", "it"]),
    ] {
        let mut c = cuda_cargo()?;
        c.args(args).args(["--locked", "--no-run", "--message-format=json-render-diagnostics"]);
        let out = c.output().map_err(|e| format!("cargo: {e}"))?;
        if !out.status.success() {
            return Err(format!("building {name} failed:\n{}", String::from_utf8_lossy(&out.stderr)));
        }
        let exe = executable(&String::from_utf8_lossy(&out.stdout))
            .ok_or_else(|| format!("cargo built no executable for {name}"))?;
        std::fs::copy(&exe, bin.join(name)).map_err(|e| format!("copy {}: {e}", exe.display()))?;
    }
    let script = dir.join("run.sh");
    std::fs::copy(root().join("xtask/gpu-check.sh"), &script)
        .map_err(|e| format!("{}: {e}", script.display()))?;
    // `nvidia-smi` stand-ins, first on PATH: one lists a GPU, one lists none
    // (as a driverless machine's, or one that has none, would).
    let smi = |name: &str, body: &str| -> Result<PathBuf, String> {
        let d = fake.join(name);
        std::fs::create_dir_all(&d).map_err(|e| format!("{}: {e}", d.display()))?;
        let f = d.join("nvidia-smi");
        std::fs::write(&f, format!("#!/bin/sh\n{body}\n")).map_err(|e| format!("{}: {e}", f.display()))?;
        let made = Command::new("chmod").arg("+x").arg(&f).status().map_err(|e| format!("chmod: {e}"))?;
        if made.success() { Ok(d) } else { Err(format!("chmod +x {} failed", f.display())) }
    };
    let lists = smi(
        "lists-a-gpu",
        r#"[ "$1" = -L ] && { echo "GPU 0: NVIDIA H200 (UUID: GPU-00000000-fake)"; exit 0; }; exit 9"#,
    )?;
    let none = smi("lists-none", "echo 'NVIDIA-SMI has failed: no devices were found' >&2; exit 9")?;
    let node = dir.join("nvidia0");
    std::fs::write(&node, "").map_err(|e| format!("{}: {e}", node.display()))?;
    let missing_node = dir.join("no-such-device-node");
    let stub_lib = crate::ptx::stub()?.join("lib64");

    let cases: [(&str, &Path, &Path, &str); 3] = [
        ("nvidia-smi lists a GPU, the stub libcuda loads", &lists, &missing_node, "FAIL"),
        ("no GPU listed, the device node exists", &none, &node, "FAIL"),
        ("no GPU listed, no device node", &none, &missing_node, "NO DEVICE"),
    ];
    for (i, (what, path_dir, device_node, want)) in cases.iter().enumerate() {
        let report = dir.join(format!("report-{i}.md"));
        let path = format!("{}:{}", path_dir.display(), std::env::var("PATH").unwrap_or_default());
        let out = Command::new("bash")
            .arg(&script)
            .arg(&report)
            .env("PATH", path)
            .env("LD_LIBRARY_PATH", &stub_lib)
            .env("ZEROPP_CHECK_DEVICE_NODE", device_node)
            .env("ZEROPP_CHECK_BUDGET_S", "120")
            .env_remove("ZEROPP_REQUIRE_GPU")
            .env_remove("ZEROPP_REQUIRE_NCCL")
            .output()
            .map_err(|e| format!("bash {}: {e}", script.display()))?;
        let md = std::fs::read_to_string(&report).map_err(|e| format!("{what}: no report: {e}"))?;
        let got = md
            .lines()
            .find_map(|l| l.strip_prefix("**Verdict: ").and_then(|v| v.strip_suffix("**")))
            .unwrap_or("none");
        let exit_ok = out.status.success() == (*want != "FAIL");
        let mut problems = Vec::new();
        if got != *want {
            problems.push(format!("verdict {got}, want {want}"));
        }
        if !exit_ok {
            problems.push(format!("exit status {}", out.status));
        }
        if i == 0 {
            // The verdict must come from the kernel tests failing at cuInit, not
            // from a step that is missing from this pack.
            let kernel_row = md.lines().find(|l| l.starts_with("| 1. kernel tests |")).unwrap_or("");
            if !kernel_row.contains("FAIL") {
                problems.push(format!("the kernel tests' row does not fail: `{kernel_row}`"));
            }
            if !md.contains("Failed driver call: CUDA cuInit failed") {
                problems.push("the report does not name the failed call (cuInit)".into());
            }
        }
        if problems.is_empty() {
            eprintln!("==> gpu check verdict, {what}: {got} (as it must be)");
        } else {
            return Err(format!(
                "gpu check verdict, {what}: {}; report {}:\n{}",
                problems.join("; "),
                report.display(),
                md.lines().take(16).collect::<Vec<_>>().join("\n")
            ));
        }
    }
    Ok(())
}

/// The test or bench executable among cargo's JSON messages.
fn executable(messages: &str) -> Option<PathBuf> {
    messages
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|m| m["reason"] == "compiler-artifact")
        .find_map(|m| m["executable"].as_str().map(PathBuf::from))
}

#[cfg(test)]
mod tests {
    use super::executable;

    #[test]
    fn the_executable_is_read_from_cargos_messages() {
        let msgs = r#"{"reason":"compiler-artifact","executable":null,"target":{"name":"zeropp_quant"}}
{"reason":"build-script-executed"}
{"reason":"compiler-artifact","executable":"/t/release/deps/it-0123","target":{"name":"it"}}
{"reason":"build-finished","success":true}"#;
        assert_eq!(executable(msgs), Some("/t/release/deps/it-0123".into()));
        assert_eq!(executable(r#"{"reason":"build-finished","success":true}"#), None);
    }
}
