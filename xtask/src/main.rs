//! `cargo xtask`: the project's developer tasks (CI, benchmarks, MPI tests).
//!
//! This crate holds no product logic: it only runs cargo (and mpirun) with the
//! right arguments and summarises criterion's output. Run `cargo xtask help`.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use serde_json::Value;

mod ci;
mod cluster;
mod cmd;
mod dist;
mod fidelity_size;
mod gpu;
mod gpu_check;
mod package;
mod plot;
mod ptx;
mod scale;
mod torch;
mod torch_floor;
mod torch_scale;
mod wheel;

use cmd::{cargo, has_mpirun, machine, root, run};

const HELP: &str = "\
cargo xtask <task>

tasks:
  ci               fmt --check, clippy -D warnings, the whole test suite, cargo doc -D warnings,
                   zeropp-quant's `cuda` feature (ptx --check, clippy, GPU + emulated-kernel tests)
                   (and the MPI tests when `mpirun` is on PATH; `--no-mpi` skips them)
  test             only the test suite (cargo test --workspace)
  bench [NAME...]  criterion benches (quant, comm, e2e, mpi; default: quant comm e2e), `gpu`, and the
                   fidelity bench (`fidelity`: ZeRO++ variants' validation loss over seeds, lrs and
                   three corpora (generated, tinyshakespeare, the Python reference);
                   ZEROPP_FIDELITY_ARGS passes options, e.g. `--seeds 8 --lrs 1e-2 --variants all`),
                   `loco-probe` (qgZ's error feedback along one exact trajectory, per corpus);
                   `qgz-error` (qgZ's MSE on real gradients: plain INT4, two-level, Hadamard);
                   `candle`: the candle adapter's step time vs the native GPT, matmul threads,
                   ZeRO++/ZeRO-3 fidelity of the candle Llama over seeds;
                   writes a markdown summary to target/bench-report/NAME.md; `cluster`: speedups
                   over ZeRO-3 on the namespace cluster against the link model (root, ~7 min);
                   `scale`: GPT sizes 1M..GPT-2 small on 2x4 threads (tokens/s, time split, memory,
                   bytes, GEMM vs numpy/OpenBLAS; ZEROPP_SCALE_SIZES, ZEROPP_SCALE_SEQ);
                   `torch`: FSDP2 with and without zeropp.torch (and zeropp's engine) on the
                   namespace cluster, 2x2 at 10 and 50 Mbit/s (root; ZEROPP_TORCH_RATES);
                   `torch-scale`: FSDP2 with and without zeropp.torch on a 99.5M-parameter HF Llama,
                   2x2 on localhost (step, peak memory, kept state, split; ZEROPP_SCALE_ROUNDS)
                   `candle-build`: the candle Llama's build (its gradient check) and first steps at
                   3 sizes: time against a step, peak against the model and the memory model, on
                   threads and under MPI limited to 1.15x the model (xtask/candle-build.sh;
                   ZEROPP_BUILD_SIZES, ZEROPP_BUILD_BEFORE);
                   `plan`: `zeropp plan`'s predictions against DeepSpeed's published ZeRO++
                   throughput on 384 V100s (prediction, publication, error), then against
                   the namespace cluster's measured steps (gpt-medium 2 x 2 at 10, 20 and
                   50 Mbit/s, ZEROPP_PLAN_RATES; needs root and OpenMPI, else says so);
                   `fidelity-size`: qwZ's and qgZ's error against the exact collectives for
                   HF Llamas of 0.9M to 99.5M parameters under FSDP2 2 x 2 and the engine's
                   GPT up to GPT-2 small's shape (tables and SVG), then the validation loss
                   against the baseline's over 600 steps: zeropp.torch against FSDP2 on
                   HF Llamas of 0.74M to 9.8M, the engine's ZeRO++ against ZeRO-3 at three
                   widths (ZEROPP_FIDELITY_SIZE_PARTS=error,loss,engine; ZEROPP_FIDELITY_SIZE_REUSE=1
                   keeps the runs already on disk, =only runs nothing; about 3 hours on 2 cores)
  test-mpi         the MPI test suite under mpirun (needs OpenMPI, builds with --features mpi)
  ptx [--check]    compile zeropp-quant's CUDA kernels (NVIDIA's pinned PyPI wheels, in
                   target/cuda-venv) into the checked-in PTX/cubins; --check: fail if stale
  gpu test|clippy|ci  zeropp-quant --features cuda (stub libcuda when no driver): GPU and
                   emulated-kernel tests (GPU ones skip without a device; ZEROPP_REQUIRE_GPU=1
                   fails instead), clippy, or all of ci's cuda steps;
                   `bench gpu` benchmarks the kernels against device memcpy;
                   `bench gpu-comm` the device collectives (qgZ/qwZ vs bf16; host-simulated + GPU);
                   `gpu nccl`: NCCL across the visible GPUs under mpirun (skips below 2 GPUs);
                   `gpu check [--pack-only]`: builds the GPU tests and benches into target/gpu-check
                   (carry it to a GPU machine, run `bash target/gpu-check/run.sh` there: one
                   markdown report, 8 minutes at most); without --pack-only it rehearses that run here
  cluster CMD      a real cluster on one machine: network namespaces, shaped links, OpenMPI over
                   TCP (`cluster run ... -- TRAIN_ARGS`, `cluster probe`; `cargo xtask cluster help`)
  test-cluster     the cluster tests (root, iproute2, OpenMPI; `--full`: 2x4 too, `--faults`:
                   network faults); run by `ci`, which fails instead of skipping under CI=true
  test-torch       the `zeropp` Python package (python/, crates/zeropp-py) with the pinned torch (2.15.0;
                   the floor, 2.9.0, beside it), in venvs under ~/.cache/zeropp (ZEROPP_TORCH_VENV):
                   kernels == Rust, zeropp.torch's collectives under torchrun (2 nodes x 2, gloo),
                   FSDP2's contract at a fault (contract.py), FSDP2 training parity over seeds
                   (ZEROPP_TORCH_SEEDS, ZEROPP_TORCH_STEPS), and seeded defects that must fail them;
                   all from the wheel (`dist`, or `--wheel PATH`) in a fresh venv without cargo;
                   run by `ci`, which fails instead of skipping under CI=true
  dist [--target TRIPLE] [--no-sdist]
                   the Python package as an abi3 wheel for manylinux_2_28 (maturin, zig as the
                   linker, auditwheel's check) and an sdist, into target/dist; tools pinned in
                   ~/.cache/zeropp/dist-venv (ZEROPP_DIST_VENV)
  package-check [--features F]
                   the published crates from their packaged tarballs: doc tests, the CLI's check,
                   and a user's crate (tests/registry-user) on zeropp-quant and zeropp-comm by version
  publish [--execute]  cargo publish --workspace in stack order; a dry run unless --execute (which
                   needs CARGO_REGISTRY_TOKEN)
  lint-workflows   actionlint over .github/workflows (pinned in the dist tools' venv), and a seeded
                   broken workflow that it must fail
  release-check TAG  the tag is v<the crates' version> and CHANGELOG.md has a dated section for it
  help             this text
";

/// The benches `cargo xtask bench` knows: (name, package, bench target, needs features).
const BENCHES: &[(&str, &str, &str, &str)] = &[
    ("quant", "zeropp-quant", "quant", ""),
    ("comm", "zeropp-comm", "comm", ""),
    ("e2e", "zeropp-run", "e2e", ""),
    ("mpi", "zeropp-comm", "mpi", "mpi"),
    ("candle", "zeropp-candle", "candle", ""),
];

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("ci") => ci::ci(&args[1..]),
        Some("test") => ci::test(),
        Some("bench") => bench(&args[1..]),
        Some("test-mpi") => ci::test_mpi(),
        Some("ptx") => ptx::ptx(&args[1..]),
        Some("gpu") => gpu::gpu(&args[1..]),
        Some("cluster") => cluster::main(&args[1..]),
        Some("test-cluster") => cluster::test(&args[1..]),
        Some("test-torch") => torch::test(&args[1..]),
        Some("dist") => dist::dist(&args[1..]),
        Some("package-check") => package::check(&args[1..]),
        Some("publish") => package::publish(&args[1..]),
        Some("lint-workflows") => dist::lint_workflows(),
        Some("release-check") => package::release_check(&args[1..]),
        Some("help") | Some("--help") | Some("-h") | None => {
            print!("{HELP}");
            Ok(())
        }
        Some(other) => Err(format!("unknown task `{other}`\n\n{HELP}")),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `bench candle-build`: builds the CLI (with MPI where `mpirun` is) and the
/// example `build_cost`, then runs `xtask/candle-build.sh`.
fn candle_build(_report_dir: &Path) -> Result<(), String> {
    let mut b = cargo();
    b.args(["build", "--release", "--locked", "-p", "zeropp"]);
    if has_mpirun() {
        b.args(["--features", "mpi"]);
    }
    run("build zeropp", b)?;
    let mut e = cargo();
    e.args(["build", "--release", "--locked", "-p", "zeropp-candle", "--example", "build_cost"]);
    run("build build_cost", e)?;
    let mut c = Command::new("bash");
    c.arg(root().join("xtask/candle-build.sh")).current_dir(root());
    run("bench candle-build", c)
}

fn bench(args: &[String]) -> Result<(), String> {
    let names: Vec<&str> = if args.is_empty() {
        vec!["quant", "comm", "e2e"]
    } else {
        args.iter().map(String::as_str).collect()
    };
    let report_dir = root().join("target/bench-report");
    std::fs::create_dir_all(&report_dir).map_err(|e| format!("{}: {e}", report_dir.display()))?;
    for name in names {
        // The benches with their own runner; the rest are criterion benches (BENCHES).
        type Runner = fn(&Path) -> Result<(), String>;
        let own: Option<Runner> = match name {
            "fidelity" => Some(fidelity),
            "loco-probe" => Some(loco_probe),
            "qgz-error" => Some(qgz_error),
            "gpu" => Some(gpu::bench),
            "gpu-comm" => Some(gpu::bench_comm),
            "scale" => Some(scale::scale),
            "cluster" => Some(cluster::bench),
            "torch" => Some(cluster::bench_torch),
            "torch-scale" => Some(torch_scale::bench),
            "candle-build" => Some(candle_build),
            "plan" => Some(plan_bench),
            "fidelity-size" => Some(fidelity_size::bench),
            _ => None,
        };
        if let Some(bench) = own {
            bench(&report_dir)?;
            continue;
        }
        let Some(&(_, package, target, features)) = BENCHES.iter().find(|b| b.0 == name) else {
            let known: Vec<&str> = BENCHES.iter().map(|b| b.0).collect();
            return Err(format!(
                "unknown bench `{name}` (known: {}, fidelity, loco-probe, qgz-error, gpu, gpu-comm, scale, cluster, torch, torch-scale, candle-build, plan, fidelity-size)",
                known.join(", ")
            ));
        };
        let home = root().join("target/criterion").join(name);
        // Start from an empty criterion home so the report holds only this run's figures.
        let _ = std::fs::remove_dir_all(&home);
        let mut c = cargo();
        c.args(["bench", "--locked", "-p", package, "--bench", target]);
        if !features.is_empty() {
            c.args(["--features", features]);
        }
        c.env("CRITERION_HOME", &home);
        run(&format!("bench {name}"), c)?;
        // Criterion benches get a ratio table; benches that cannot run under
        // criterion (e2e training runs, the MPI bench relaunched under mpirun) write
        // their own target/bench-report/NAME.md, which is left as it is.
        let out = report_dir.join(format!("{name}.md"));
        match summarise(name, &home)? {
            Some(md) => std::fs::write(&out, md).map_err(|e| format!("{}: {e}", out.display()))?,
            None => eprintln!("==> no criterion measurements: the bench wrote its own report"),
        }
        eprintln!("==> wrote {}", out.display());
    }
    Ok(())
}

/// The fidelity bench: training runs, not criterion timings, so it is an example
/// binary of zeropp-run that writes its own markdown report. Its corpora are
/// the generated text, tinyshakespeare (when `../shared/data` has it) and the
/// Python language reference ([`python_reference`]); `ZEROPP_FIDELITY_ARGS`
/// adds or overrides options (`--seeds`, `--lrs`, `--variants`, `--data`).
fn fidelity(report_dir: &Path) -> Result<(), String> {
    let out = report_dir.join("fidelity.md");
    let mut c = cargo();
    c.args(["run", "--locked", "--release", "-p", "zeropp-run", "--example", "fidelity", "--"]);
    let extra = std::env::var("ZEROPP_FIDELITY_ARGS").unwrap_or_default();
    if !extra.contains("--data") {
        c.arg("--data").arg(corpora()?);
    }
    c.args(extra.split_whitespace());
    c.arg("--out").arg(&out);
    run("bench fidelity", c)?;
    eprintln!("==> wrote {}", out.display());
    Ok(())
}

/// The error-feedback probe (`loco_probe` example): qgZ with and without error
/// feedback, nearest and stochastic rounding, along one exact trajectory, on
/// each corpus of the fidelity bench; one report, `target/bench-report/loco-probe.md`.
fn loco_probe(report_dir: &Path) -> Result<(), String> {
    let out = report_dir.join("loco-probe.md");
    let mut md = String::from(
        "# bench `loco-probe`: what qgZ's error feedback does along one exact trajectory\n\n\
         Columns: see the `loco_probe` example's docs. Per corpus, lr 1e-2 (the CLI's default before issue 26, where LoCo trained worse) and seed 1.\n\n",
    );
    for corpus in corpora()?.split(',') {
        let part = report_dir.join("loco-probe-part.md");
        let mut c = cargo();
        c.args(["run", "--locked", "--release", "-p", "zeropp-engine", "--example", "loco_probe", "--"]);
        c.args(["--data", corpus, "--lr", "1e-2", "--out"]).arg(&part);
        run(&format!("bench loco-probe ({corpus})"), c)?;
        md += &std::fs::read_to_string(&part).map_err(|e| format!("{}: {e}", part.display()))?;
        md.push('\n');
    }
    std::fs::write(&out, md).map_err(|e| format!("{}: {e}", out.display()))?;
    eprintln!("==> wrote {}", out.display());
    Ok(())
}

/// qgZ's error on real gradients (`qgz_error` example): plain INT4 against
/// SDP4Bit's two levels and Hadamard smoothing, along one exact trajectory,
/// on each corpus of the fidelity bench; `target/bench-report/qgz-error.md`.
fn qgz_error(report_dir: &Path) -> Result<(), String> {
    let out = report_dir.join("qgz-error.md");
    let mut md = String::from("# bench `qgz-error`: qgZ's error on gradients captured from training\n\n");
    for corpus in corpora()?.split(',') {
        let part = report_dir.join("qgz-error-part.md");
        let mut c = cargo();
        c.args(["run", "--locked", "--release", "-p", "zeropp-engine", "--example", "qgz_error", "--"]);
        c.args(["--data", corpus, "--out"]).arg(&part);
        run(&format!("bench qgz-error ({corpus})"), c)?;
        md += &std::fs::read_to_string(&part).map_err(|e| format!("{}: {e}", part.display()))?;
        md.push('\n');
    }
    std::fs::write(&out, md).map_err(|e| format!("{}: {e}", out.display()))?;
    eprintln!("==> wrote {}", out.display());
    Ok(())
}

/// `bench plan`: the planner against the published ZeRO++ figures (the
/// `plan_published` example of zeropp-run), then against the namespace
/// cluster, the engine's job (`cluster::bench_plan_cluster`) and a PyTorch
/// FSDP2 job (`cluster::bench_plan_torch`), and the FSDP2 memory model against
/// tracked peaks (`cluster::bench_plan_memory`); `target/bench-report/plan.md`.
fn plan_bench(report_dir: &Path) -> Result<(), String> {
    let out = report_dir.join("plan.md");
    // `ZEROPP_PLAN_PARTS`: which of the four to run (all by default).
    const PARTS: [&str; 4] = ["published", "cluster", "torch", "memory"];
    let parts = std::env::var("ZEROPP_PLAN_PARTS").unwrap_or_else(|_| PARTS.join(","));
    if let Some(bad) = parts.split(',').map(str::trim).find(|p| !PARTS.contains(p)) {
        return Err(format!("ZEROPP_PLAN_PARTS: unknown part `{bad}` (known: {})", PARTS.join(", ")));
    }
    let has = |p: &str| parts.split(',').any(|x| x.trim() == p);
    let mut md = String::new();
    if has("published") {
        let mut c = cargo();
        c.args(["run", "--locked", "--release", "-q", "-p", "zeropp-run", "--example", "plan_published"]);
        eprintln!("==> bench plan: {c:?}");
        let o = c.output().map_err(|e| format!("bench plan: {e}"))?;
        if !o.status.success() {
            return Err(format!("bench plan failed ({}): {}", o.status, String::from_utf8_lossy(&o.stderr)));
        }
        md += &String::from_utf8_lossy(&o.stdout);
    }
    if has("cluster") {
        md += &cluster::bench_plan_cluster()?;
    }
    if has("torch") {
        md += &cluster::bench_plan_torch()?;
    }
    if has("memory") {
        md += &cluster::bench_plan_memory()?;
    }
    print!("{md}");
    std::fs::write(&out, md.as_bytes()).map_err(|e| format!("{}: {e}", out.display()))?;
    eprintln!("==> wrote {}", out.display());
    Ok(())
}

/// The fidelity corpora, for `--data`: `generated`, `shakespeare` when
/// `../shared/data/tinyshakespeare.txt` exists, and the Python reference text.
fn corpora() -> Result<String, String> {
    let mut v = vec!["generated".to_string()];
    if root().join("../shared/data/tinyshakespeare.txt").is_file() {
        v.push("shakespeare".into());
    } else {
        eprintln!("==> tinyshakespeare skipped: ../shared/data/tinyshakespeare.txt is absent");
    }
    v.push(python_reference()?.display().to_string());
    Ok(v.join(","))
}

/// A third English corpus for the fidelity benches, made on the spot: the first
/// 120,000 characters of the Python language reference that CPython ships
/// (`pydoc_data.topics`, its topics in sorted order), about the size of the
/// held-out text of issue 18. Written to `target/fidelity/python-reference.txt`.
fn python_reference() -> Result<PathBuf, String> {
    let dir = root().join("target/fidelity");
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let path = dir.join("python-reference.txt");
    let script = "import sys, pydoc_data.topics as t\n\
                  text = '\\n'.join(t.topics[k] for k in sorted(t.topics))[:120000]\n\
                  open(sys.argv[1], 'w', encoding='utf-8').write(text)\n";
    let mut c = Command::new("python3");
    c.args(["-c", script]).arg(&path);
    run("the Python reference corpus (pydoc_data.topics)", c)?;
    Ok(path)
}

/// One criterion measurement: mean time and (optional) bytes of throughput per iteration.
struct Measurement {
    function: String,
    mean_ns: f64,
    bytes: Option<f64>,
}

/// Reads every `benchmark.json` + `estimates.json` under `home` and renders a
/// markdown table per group, with each row's throughput as a ratio to the row named
/// `memcpy` (or starting with `baseline`) of the same group and parameter.
fn summarise(name: &str, home: &Path) -> Result<Option<String>, String> {
    let mut groups: BTreeMap<(String, String), Vec<Measurement>> = BTreeMap::new();
    let mut stack = vec![home.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else { continue };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                if path.file_name().is_some_and(|n| n == "new") {
                    if let Some((key, m)) = read_measurement(&path) {
                        groups.entry(key).or_default().push(m);
                    }
                } else {
                    stack.push(path);
                }
            }
        }
    }
    let mut md = String::new();
    let _ = writeln!(md, "# bench `{name}`\n");
    let _ = writeln!(
        md,
        "Ratios compare rows of the same group and size, measured in the same run \
         (reference row: `memcpy` or `baseline*`). Machine: {}.\n",
        machine()
    );
    if groups.is_empty() {
        return Ok(None);
    }
    for ((group, param), mut rows) in groups {
        rows.sort_by(|a, b| a.function.cmp(&b.function));
        let reference = rows
            .iter()
            .find(|m| m.function == "memcpy" || m.function.starts_with("baseline"))
            .map(|m| (m.function.clone(), m.mean_ns, m.bytes));
        let _ = writeln!(md, "## {group} / {param}\n");
        let ref_name = reference.as_ref().map_or("-".to_string(), |r| r.0.clone());
        let _ = writeln!(md, "| function | mean time | GB/s | ratio to `{ref_name}` |");
        let _ = writeln!(md, "|---|---|---|---|");
        for m in &rows {
            let gbs = m.bytes.map(|b| b / m.mean_ns);
            let ratio = match (&reference, gbs) {
                (Some((_, _, Some(rb))), Some(g)) => {
                    let rg = rb / reference.as_ref().map_or(1.0, |r| r.1);
                    format!("{:.2}x", g / rg)
                }
                (Some((_, rt, _)), None) => format!("{:.2}x time", m.mean_ns / rt),
                _ => "-".into(),
            };
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} |",
                m.function,
                fmt_ns(m.mean_ns),
                gbs.map_or("-".into(), |g| format!("{g:.2}")),
                ratio
            );
        }
        let _ = writeln!(md);
    }
    Ok(Some(md))
}

fn read_measurement(new_dir: &Path) -> Option<((String, String), Measurement)> {
    let bench: Value =
        serde_json::from_str(&std::fs::read_to_string(new_dir.join("benchmark.json")).ok()?).ok()?;
    let est: Value =
        serde_json::from_str(&std::fs::read_to_string(new_dir.join("estimates.json")).ok()?).ok()?;
    let group = bench.get("group_id")?.as_str()?.to_string();
    let function = bench.get("function_id").and_then(Value::as_str).unwrap_or("").to_string();
    let param = bench.get("value_str").and_then(Value::as_str).unwrap_or("").to_string();
    let mean_ns = est.get("mean")?.get("point_estimate")?.as_f64()?;
    let bytes = bench
        .get("throughput")
        .and_then(|t| t.get("Bytes").or_else(|| t.get("BytesDecimal")))
        .and_then(Value::as_f64);
    Some(((group, param), Measurement { function, mean_ns, bytes }))
}

fn fmt_ns(ns: f64) -> String {
    if ns >= 1e9 {
        format!("{:.3} s", ns / 1e9)
    } else if ns >= 1e6 {
        format!("{:.3} ms", ns / 1e6)
    } else if ns >= 1e3 {
        format!("{:.3} µs", ns / 1e3)
    } else {
        format!("{ns:.1} ns")
    }
}
