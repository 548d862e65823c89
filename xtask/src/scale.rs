//! `cargo xtask bench scale`: GPT sizes from 1M to GPT-2 small's shape on 8
//! ranks (2 nodes x 4, thread backend), one process per size (the
//! `zeropp-run` example `scale`), plus the GEMM rate of each size's largest
//! linear shapes against a reference SGEMM (numpy on OpenBLAS, installed by this
//! bench into `target/scale-venv` with pip) on the same shapes in the same run.
//! Writes `target/bench-report/scale.md`.
//!
//! `ZEROPP_SCALE_SIZES` picks the sizes (comma-separated presets, default
//! `gpt-1m,gpt-10m,gpt-40m,gpt2-small`); `ZEROPP_SCALE_SEQ` the context (256).
//! When `mpirun` is present (and `ZEROPP_SCALE_MPI` is not `0`) each size also runs
//! under MPI (`zeropp train --backend mpi`, built with the `mpi` feature), with each
//! rank's peak RSS against the memory model.

use std::fmt::Write as _;
use std::path::Path;
use std::process::Command;
use std::time::Instant;

use serde_json::Value;

use crate::cmd::{cargo, root, run};

/// The reference SGEMM: numpy `A @ B` in f32 on one thread (the engine's GEMM
/// runs one call per thread), the fastest of several calls, in GFLOP/s.
const NUMPY_REF: &str = r#"
import json, sys, time
import numpy as np
out = []
for m, k, n in json.loads(sys.argv[1]):
    a = (np.arange(m * k, dtype=np.float32) % 17 - 8).reshape(m, k) * 0.01
    b = (np.arange(k * n, dtype=np.float32) % 13 - 6).reshape(k, n) * 0.01
    a @ b
    flops = 2.0 * m * k * n
    best = float("inf")
    for _ in range(max(5, min(30, int(1e10 / flops)))):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    out.append(flops / best / 1e9)
print(json.dumps(out))
"#;

/// The OpenBLAS kernel sets the GEMM reference is measured with: OpenBLAS's own
/// choice (`None`), plus its AVX-512 kernels where the CPU has AVX-512.
fn openblas_coretypes() -> Vec<Option<&'static str>> {
    let avx512 = std::fs::read_to_string("/proc/cpuinfo").is_ok_and(|c| c.contains(" avx512f"));
    if avx512 { vec![None, Some("SKYLAKEX")] } else { vec![None] }
}

fn example() -> Command {
    let mut c = Command::new(root().join("target/release/examples/scale"));
    c.current_dir(root());
    c
}

/// Runs `cmd`, returning its last stdout line as JSON.
fn json_of(what: &str, mut cmd: Command) -> Result<Value, String> {
    eprintln!("\n==> {what}: {cmd:?}");
    let out = cmd.output().map_err(|e| format!("{what}: could not start: {e}"))?;
    if !out.status.success() {
        return Err(format!("{what} failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr)));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().last().unwrap_or_default();
    serde_json::from_str(line).map_err(|e| format!("{what}: bad output {line:?}: {e}"))
}

/// The venv's python with numpy, created on first use; `None` (with a message)
/// when pip cannot install numpy.
fn numpy_python() -> Option<std::path::PathBuf> {
    let venv = root().join("target/scale-venv");
    let py = venv.join("bin/python");
    let has_numpy = |py: &Path| {
        Command::new(py).args(["-c", "import numpy"]).output().map(|o| o.status.success()).unwrap_or(false)
    };
    if !has_numpy(&py) {
        let mut mk = Command::new("python3");
        mk.args(["-m", "venv"]).arg(&venv);
        let mut pip = Command::new(&py);
        pip.args(["-m", "pip", "install", "--quiet", "numpy"]);
        if run("venv for the reference SGEMM", mk).and_then(|()| run("pip install numpy", pip)).is_err() {
            eprintln!("==> no numpy: the GEMM ratio column is left empty");
            return None;
        }
    }
    has_numpy(&py).then_some(py)
}

/// One size under MPI: `mpirun -np 8` of `zeropp train --backend mpi` (2 nodes x 4
/// simulated on this host), 3 steps. Returns the table row: tokens/s (steps 2-3),
/// the largest per-rank peak RSS against the memory model, and whether the
/// counters equal the model.
fn mpi_row(name: &str, seq: &str) -> Result<String, String> {
    let metrics = root().join(format!("target/scale-mpi-{name}.jsonl"));
    let mut c = Command::new("mpirun");
    c.current_dir(root());
    c.env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("OMPI_MCA_rmaps_base_oversubscribe", "1");
    c.args(["-np", "8"]).arg(root().join("target/release/zeropp"));
    c.args([
        "train",
        "--backend",
        "mpi",
        "--local-size",
        "4",
        "--steps",
        "3",
        "--batch",
        "8",
        "--eval-batches",
        "0",
    ]);
    c.arg("--model").arg(format!("{name}:seq={seq}")).arg("--metrics").arg(&metrics);
    eprintln!("\n==> {name} under MPI: {c:?}");
    let t = Instant::now();
    let out = c.output().map_err(|e| format!("mpirun: {e}"))?;
    let secs = t.elapsed().as_secs_f64();
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        return Err(format!("{name} under MPI failed ({}): {stderr}", out.status));
    }
    // `memory: peak RSS of rank R X MB; memory model Y MB (...)`, one line per rank.
    let ratio = stderr
        .lines()
        .filter_map(|l| {
            let l = l.split("memory: peak RSS of rank ").nth(1)?;
            let mb = |s: &str| s.split_whitespace().next()?.parse::<f64>().ok();
            let peak = mb(l.split_once(' ')?.1)?;
            let model = mb(l.split("memory model ").nth(1)?)?;
            Some(peak / model)
        })
        .fold(f64::NAN, f64::max);
    let text = std::fs::read_to_string(&metrics).map_err(|e| format!("{}: {e}", metrics.display()))?;
    let lines: Vec<Value> = text.lines().filter_map(|l| serde_json::from_str(l).ok()).collect();
    let steps: Vec<&Value> = lines.iter().filter(|v| v.get("step").is_some()).skip(1).collect();
    let tokens = steps.iter().map(|v| f(v, "tokens_per_s")).sum::<f64>() / steps.len().max(1) as f64;
    let exact = lines.iter().find_map(|v| v.get("summary")).is_some_and(|s| {
        s.get("bytes_by_op").is_some() && s.get("bytes_by_op") == s.get("model_bytes_by_op")
    });
    Ok(format!(
        "| {name} | {tokens:.0} | {ratio:.2} | {} | {secs:.0} s |\n",
        if exact { "yes" } else { "NO" }
    ))
}

fn f(v: &Value, key: &str) -> f64 {
    v.get(key).and_then(Value::as_f64).unwrap_or(f64::NAN)
}

/// The scale bench (see the module docs).
pub(crate) fn scale(report_dir: &Path) -> Result<(), String> {
    let sizes =
        std::env::var("ZEROPP_SCALE_SIZES").unwrap_or_else(|_| "gpt-1m,gpt-10m,gpt-40m,gpt2-small".into());
    let seq = std::env::var("ZEROPP_SCALE_SEQ").unwrap_or_else(|_| "256".into());
    let mut build = cargo();
    build.args(["build", "--locked", "--release", "-p", "zeropp-run", "--example", "scale"]);
    run("build the scale example", build)?;
    let python = numpy_python();
    let mpi = std::env::var("ZEROPP_SCALE_MPI").map_or(true, |v| v != "0")
        && Command::new("mpirun").arg("--version").output().is_ok_and(|o| o.status.success());
    let mpi = mpi && {
        let mut b = cargo();
        b.args(["build", "--locked", "--release", "-p", "zeropp", "--features", "mpi"]);
        run("build zeropp with MPI", b).is_ok()
    };
    let mut mpi_table = String::new();
    let mut table = String::new();
    let mut gemm_table = String::new();
    let mut single = String::new();
    for name in sizes.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let t = Instant::now();
        let mut c = example();
        c.args(["--model", name, "--seq", &seq, "--steps", "3", "--mode", "zeropp"]);
        let zpp = json_of(&format!("{name} zeropp"), c)?;
        let secs = t.elapsed().as_secs_f64();
        let mut c = example();
        c.args(["--model", name, "--seq", &seq, "--steps", "1", "--mode", "zero3"]);
        let z3 = json_of(&format!("{name} zero3"), c)?;
        let step = f(&zpp, "step_s");
        let split = |key: &str| 100.0 * f(&zpp, key) / step;
        let rss = f(&zpp, "peak_rss_bytes");
        let predicted = f(&zpp, "predicted_rank_bytes") * f(&zpp, "world");
        let _ = writeln!(
            table,
            "| {name} | {:.1}M | {:.0} | {:.2} | {:.0}% / {:.0}% / {:.0}% / {:.1}% | {:.2} GB / {:.2} GB = {:.2} | {:.0} KB / {:.0} KB = {:.3} | {} | {secs:.0} s |",
            f(&zpp, "params") / 1e6,
            f(&zpp, "tokens_per_s"),
            step,
            split("compute_s"),
            split("comm_s"),
            split("quant_s"),
            split("optim_s"),
            rss / 1e9,
            predicted / 1e9,
            rss / predicted,
            f(&zpp, "inter_bytes") / 1e3,
            f(&z3, "inter_bytes") / 1e3,
            f(&zpp, "inter_bytes") / f(&z3, "inter_bytes"),
            if zpp["bytes_exact"] == Value::Bool(true) && z3["bytes_exact"] == Value::Bool(true) {
                "yes"
            } else {
                "NO"
            },
        );
        if mpi {
            match mpi_row(name, &seq) {
                Ok(row) => mpi_table += &row,
                Err(e) => {
                    eprintln!("==> {e}");
                    mpi_table += &format!("| {name} | failed (see the log) | | | |\n");
                }
            }
        }
        // GEMM: the engine's rate and the reference's on the same shapes,
        // alternated three times (best of each kept): the machine may be busy.
        let mut gemm = Value::Null;
        let mut refs: Vec<f64> = Vec::new();
        for _ in 0..3 {
            let mut c = example();
            c.args(["--model", name, "--seq", &seq, "--gemm"]);
            let g = json_of(&format!("{name} gemm"), c)?;
            gemm = match gemm {
                Value::Null => g,
                mut best => {
                    if let (Some(b), Some(n)) = (best["gemm"].as_array_mut(), g["gemm"].as_array()) {
                        for (b, n) in b.iter_mut().zip(n) {
                            if f(n, "gflops") > f(b, "gflops") {
                                *b = n.clone();
                            }
                        }
                    }
                    best
                }
            };
            let shapes: Vec<[u64; 3]> = gemm["gemm"]
                .as_array()
                .map(|a| {
                    a.iter()
                        .map(|s| {
                            [
                                s["m"].as_u64().unwrap_or(0),
                                s["k"].as_u64().unwrap_or(0),
                                s["n"].as_u64().unwrap_or(0),
                            ]
                        })
                        .collect()
                })
                .unwrap_or_default();
            // OpenBLAS picks its kernels by CPU model and may not know this one
            // (seen: an AVX-512 EPYC run with its AVX2 "Haswell" kernels at about
            // half speed), so the reference is the best of its own choice and,
            // where the CPU has AVX-512, its AVX-512 kernels.
            for coretype in openblas_coretypes() {
                let Some(py) = &python else { break };
                let mut c = Command::new(py);
                c.args(["-c", NUMPY_REF]).arg(serde_json::to_string(&shapes).unwrap_or_default());
                c.env("OPENBLAS_NUM_THREADS", "1").env("OMP_NUM_THREADS", "1");
                if let Some(t) = coretype {
                    c.env("OPENBLAS_CORETYPE", t);
                }
                let r: Vec<f64> = json_of(&format!("{name} numpy reference ({coretype:?})"), c)?
                    .as_array()
                    .map(|a| a.iter().filter_map(Value::as_f64).collect())
                    .unwrap_or_default();
                refs =
                    if refs.is_empty() { r } else { refs.iter().zip(&r).map(|(a, b)| a.max(*b)).collect() };
            }
        }
        for (i, s) in gemm["gemm"].as_array().into_iter().flatten().enumerate() {
            let ours = f(s, "gflops");
            let reference = refs.get(i).copied().unwrap_or(f64::NAN);
            let _ = writeln!(
                gemm_table,
                "| {name} | {} x {} x {} | {ours:.1} | {reference:.1} | {:.2} |",
                s["m"],
                s["k"],
                s["n"],
                ours / reference
            );
        }
    }
    // Single rank at the largest size: the step against its compute alone.
    if let Some(largest) = sizes.split(',').map(str::trim).rfind(|s| !s.is_empty()) {
        let mut c = example();
        c.args([
            "--model", largest, "--seq", &seq, "--steps", "2", "--world", "1", "--local", "1", "--mode",
            "zeropp",
        ]);
        let one = json_of(&format!("{largest} single rank"), c)?;
        let _ = writeln!(
            single,
            "single rank, {largest}: step {:.2} s, compute {:.2} s, step / compute = {:.3} (comm {:.3} s, optimizer {:.3} s)",
            f(&one, "step_s"),
            f(&one, "compute_s"),
            f(&one, "step_s") / f(&one, "compute_s"),
            f(&one, "comm_s"),
            f(&one, "optim_s"),
        );
    }
    let md = format!(
        "# scale bench\n\n{}\n\nGPT presets on 8 ranks (2 nodes x 4, thread backend, one process per size), context {seq}, \
         global batch 8, ZeRO++ defaults, 3 steps (timings: mean of steps 2-3). Time split of the slowest rank: \
         compute / communication / quantization (inside the collectives, on the rank's thread) / optimizer. Memory: the process's peak RSS against 8 x the \
         memory model's per-rank prediction. Cross-node bytes per rank per step: ZeRO++ / ZeRO-3 (hierarchical), \
         counters equal to the analytic model exactly (`exact`).\n\n\
         | model | params | tokens/s | step s | compute / comm / quant / optim | peak RSS / predicted | inter-node ZeRO++ / ZeRO-3 | exact | wall (ZeRO++ run) |\n\
         |---|---|---|---|---|---|---|---|---|\n{table}\n\
         GEMM, the model's largest linear shapes at one rank's rows, one thread: the engine's GEMM against numpy's \
         (OpenBLAS) SGEMM in the same run.\n\n\
         | model | m x k x n | engine GFLOP/s | reference GFLOP/s | ratio |\n|---|---|---|---|---|\n{gemm_table}\n{single}\n{}",
        crate::cmd::machine(),
        if mpi_table.is_empty() {
            "MPI: not run (no mpirun, ZEROPP_SCALE_MPI=0, or the MPI build failed).\n".to_string()
        } else {
            format!(
                "\nThe same sizes under MPI (`mpirun -np 8`, one process per rank, 2 simulated nodes x 4, ZeRO++, 3 steps): \
                 tokens/s (steps 2-3), the largest per-rank peak RSS over the memory model's per-rank prediction, \
                 counters equal to the model.\n\n| model | tokens/s | peak RSS / model (worst rank) | exact | wall |\n\
                 |---|---|---|---|---|\n{mpi_table}"
            )
        }
    );
    let out = report_dir.join("scale.md");
    std::fs::write(&out, &md).map_err(|e| format!("{}: {e}", out.display()))?;
    print!("{md}");
    eprintln!("==> wrote {}", out.display());
    Ok(())
}
