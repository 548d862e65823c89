//! `cargo xtask cluster`: a real cluster on one machine.
//!
//! Network namespaces joined by a bridge, each node's uplink shaped with `tc`, and
//! OpenMPI over TCP between them (shared memory within a node). The namespaces, veths,
//! shaping and the `mpirun` launch live in `xtask/cluster.sh`; this module builds the
//! programs, drives the script, and checks and summarises what it measured:
//!
//! - `cluster run`: one `zeropp train --backend mpi` across the cluster, with the
//!   metrics and the kernel's interface counters in `--out`;
//! - `cluster probe`: node-to-node MPI bandwidth, achieved / configured;
//! - `test-cluster` (run by `cargo xtask ci`): losses bitwise equal to the thread
//!   backend, kernel bytes against the project's counters, the transport per pair;
//!   with `--faults`, the network fault tests;
//! - `bench cluster`: step-time speedups over ZeRO-3 per inter-node rate, against the
//!   link model's prediction for the same configuration.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use serde_json::Value;

use crate::{cargo, root, run as run_step};

const HELP: &str = "\
cargo xtask cluster <command>

commands:
  run --nodes N --local-size L --rate RATE --delay DELAY [--loss P] [--jitter J] [--out DIR]
      [--time-limit S] [--debug] -- ZEROPP_TRAIN_ARGS...
        builds zeropp (--features mpi), brings up N network namespaces with shaped uplinks
        (RATE: 100mbit, 1gbit, ..., or unshaped; DELAY: 5ms, 0; LOSS in percent) and runs
        `zeropp train --backend mpi --local-size L ZEROPP_TRAIN_ARGS` across them under
        mpirun (TCP between nodes, shared memory within). Writes DIR/metrics.jsonl,
        DIR/netdev.json (each node's kernel counters before/after) and prints one summary.
  probe [--rates R1,R2,...]
        node-to-node bandwidth through MPI send/recv, achieved/configured (default 100mbit,1gbit)
  clean
        deletes namespaces left by runs whose process is gone (zpp-*)
Needs root, iproute2 and OpenMPI. `cargo xtask test-cluster` and `cargo xtask bench cluster`
use the same machinery.
";

/// The shape of one cluster: nodes, ranks per node and the uplinks.
#[derive(Clone, Debug)]
pub(crate) struct Shape {
    nodes: usize,
    local_size: usize,
    rate: String,
    delay: String,
    loss: Option<String>,
    jitter: Option<String>,
}

impl Shape {
    fn new(nodes: usize, local_size: usize, rate: &str) -> Self {
        Self { nodes, local_size, rate: rate.into(), delay: "0".into(), loss: None, jitter: None }
    }
    fn world(&self) -> usize {
        self.nodes * self.local_size
    }
}

/// Extra knobs of one launch.
#[derive(Default)]
struct Launch {
    time_limit_s: u64,
    btl_verbose: bool,
    fault: Option<String>,
    env: Vec<(String, String)>,
}

/// What one launch left behind.
struct Outcome {
    success: bool,
    code: Option<i32>,
    wall_s: f64,
    log: String,
}

pub(crate) fn main(args: &[String]) -> Result<(), String> {
    match args.first().map(String::as_str) {
        Some("run") => run_cmd(&args[1..]),
        Some("probe") => probe(&args[1..]),
        Some("clean") => clean(),
        Some("help") | Some("--help") | Some("-h") | None => {
            print!("{HELP}");
            Ok(())
        }
        Some(other) => Err(format!("cluster: unknown command `{other}`\n\n{HELP}")),
    }
}

fn script() -> PathBuf {
    root().join("xtask/cluster.sh")
}

fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| root().join("target"), PathBuf::from)
}

/// Builds `zeropp` with MPI support and returns the binary.
fn build_zeropp(release: bool) -> Result<PathBuf, String> {
    let mut c = cargo();
    c.args(["build", "--locked", "-p", "zeropp", "--features", "mpi"]);
    if release {
        c.arg("--release");
    }
    run_step("build zeropp (mpi)", c)?;
    Ok(target_dir().join(if release { "release" } else { "debug" }).join("zeropp"))
}

/// Runs `cluster.sh` with `shape` and `program args`; the output goes to `out/run.log`
/// (and is returned), or to the terminal when `echo` is set.
fn launch(
    shape: &Shape,
    out: &Path,
    opts: &Launch,
    program: &Path,
    args: &[String],
    echo: bool,
) -> Result<Outcome, String> {
    std::fs::create_dir_all(out).map_err(|e| format!("{}: {e}", out.display()))?;
    let mut c = Command::new("bash");
    c.arg(script())
        .args(["--nodes", &shape.nodes.to_string(), "--local-size", &shape.local_size.to_string()])
        .args(["--rate", &shape.rate, "--delay", &shape.delay])
        .arg("--out")
        .arg(out)
        .args(["--time-limit", &opts.time_limit_s.max(1).to_string()]);
    if let Some(l) = &shape.loss {
        c.args(["--loss", l]);
    }
    if let Some(j) = &shape.jitter {
        c.args(["--jitter", j]);
    }
    if opts.btl_verbose {
        c.arg("--mpi-verbose");
    }
    if let Some(f) = &opts.fault {
        c.args(["--fault", f]);
    }
    c.arg("--");
    for (k, v) in &opts.env {
        c.args(["-x", &format!("{k}={v}")]);
    }
    c.arg(program).args(args);
    for (k, v) in &opts.env {
        c.env(k, v);
    }
    let log_path = out.join("run.log");
    let start = Instant::now();
    let status = if echo {
        c.status()
    } else {
        let log = std::fs::File::create(&log_path).map_err(|e| format!("{}: {e}", log_path.display()))?;
        let err = log.try_clone().map_err(|e| e.to_string())?;
        c.stdout(Stdio::from(log)).stderr(Stdio::from(err)).status()
    }
    .map_err(|e| format!("cluster.sh: could not start: {e}"))?;
    let log = if echo { String::new() } else { std::fs::read_to_string(&log_path).unwrap_or_default() };
    Ok(Outcome { success: status.success(), code: status.code(), wall_s: start.elapsed().as_secs_f64(), log })
}

fn value<'a>(args: &'a [String], i: &mut usize, flag: &str) -> Result<&'a str, String> {
    *i += 1;
    args.get(*i).map(String::as_str).ok_or_else(|| format!("{flag} needs a value"))
}

fn run_cmd(args: &[String]) -> Result<(), String> {
    let mut shape = Shape::new(2, 4, "unshaped");
    let mut out = None;
    let mut release = true;
    let mut time_limit_s = 1800;
    let split = args.iter().position(|a| a == "--").unwrap_or(args.len());
    let (ours, train) = (&args[..split], args.get(split + 1..).unwrap_or(&[]));
    let mut i = 0;
    while i < ours.len() {
        let flag = ours[i].as_str();
        match flag {
            "--nodes" => shape.nodes = parse_num(value(ours, &mut i, flag)?, flag)?,
            "--local-size" => shape.local_size = parse_num(value(ours, &mut i, flag)?, flag)?,
            "--rate" => shape.rate = value(ours, &mut i, flag)?.into(),
            "--delay" => shape.delay = value(ours, &mut i, flag)?.into(),
            "--loss" => shape.loss = Some(value(ours, &mut i, flag)?.into()),
            "--jitter" => shape.jitter = Some(value(ours, &mut i, flag)?.into()),
            "--out" => out = Some(PathBuf::from(value(ours, &mut i, flag)?)),
            "--time-limit" => time_limit_s = parse_num(value(ours, &mut i, flag)?, flag)? as u64,
            "--debug" => release = false,
            other => return Err(format!("cluster run: unknown option `{other}`\n\n{HELP}")),
        }
        i += 1;
    }
    if shape.nodes < 1 || shape.local_size < 1 {
        return Err("cluster run: --nodes and --local-size must be at least 1".into());
    }
    let out = out.unwrap_or_else(|| target_dir().join("cluster").join(format!("run-{}", std::process::id())));
    let zeropp = build_zeropp(release)?;
    let metrics = out.join("metrics.jsonl");
    let _ = std::fs::remove_file(&metrics);
    let mut targs: Vec<String> = vec!["train".into(), "--backend".into(), "mpi".into()];
    targs.extend(["--local-size".into(), shape.local_size.to_string()]);
    targs.extend(train.iter().cloned());
    targs.extend(["--metrics".into(), metrics.display().to_string()]);
    let outcome = launch(&shape, &out, &Launch { time_limit_s, ..Launch::default() }, &zeropp, &targs, true)?;
    println!("{}", summary_line(&shape, &out, &outcome));
    if outcome.success { Ok(()) } else { Err(format!("the cluster run failed (exit {:?})", outcome.code)) }
}

fn parse_num(s: &str, flag: &str) -> Result<usize, String> {
    s.parse().map_err(|_| format!("{flag}: `{s}` is not a whole number"))
}

/// The run's metrics: (per-step records, summary).
fn read_metrics(path: &Path) -> Result<(Vec<Value>, Value), String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut steps = Vec::new();
    let mut summary = Value::Null;
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let v: Value = serde_json::from_str(line).map_err(|e| format!("{}: {e}", path.display()))?;
        if let Some(s) = v.get("summary") {
            summary = s.clone();
        } else if v.get("loss").is_some() {
            steps.push(v);
        }
    }
    Ok((steps, summary))
}

/// Kernel bytes sent by all nodes' uplinks during the run (the cross-node traffic: a
/// node's uplink carries nothing else).
fn kernel_tx(out: &Path) -> Result<f64, String> {
    let path = out.join("netdev.json");
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let v: Value = serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    let nodes = v.get("nodes").and_then(Value::as_array).ok_or("netdev.json: no nodes")?;
    Ok(nodes
        .iter()
        .map(|n| {
            let f = |k: &str| n.get(k).and_then(Value::as_f64).unwrap_or(0.0);
            f("tx_bytes_after") - f("tx_bytes_before")
        })
        .sum())
}

/// The project's inter-node bytes of the whole run, all ranks (the metrics hold means per rank).
fn project_inter(steps: &[Value], world: usize) -> f64 {
    steps.iter().filter_map(|s| s.get("inter_node_bytes").and_then(Value::as_f64)).sum::<f64>() * world as f64
}

fn summary_line(shape: &Shape, out: &Path, o: &Outcome) -> String {
    let mut line = format!(
        "cluster: {}x{} at {} (delay {}{}), exit {}, {:.1} s",
        shape.nodes,
        shape.local_size,
        shape.rate,
        shape.delay,
        shape.loss.as_ref().map_or(String::new(), |l| format!(", loss {l}%")),
        o.code.map_or("signal".into(), |c| c.to_string()),
        o.wall_s
    );
    if let Ok((steps, summary)) = read_metrics(&out.join("metrics.jsonl")) {
        let f = |k: &str| summary.get(k).and_then(Value::as_f64).unwrap_or(f64::NAN);
        let inter = project_inter(&steps, shape.world());
        let _ = write!(
            line,
            "; {} steps, mean step {:.4} s, final loss {:.6}; inter-node bytes: project {:.0}",
            steps.len(),
            f("mean_step_time_s"),
            f("final_loss"),
            inter
        );
        if let Ok(k) = kernel_tx(out) {
            let _ = write!(line, ", kernel {k:.0} (kernel/project {:.3})", k / inter);
        }
    } else if let Ok(k) = kernel_tx(out) {
        let _ = write!(line, "; kernel tx {k:.0} bytes");
    }
    let _ = write!(line, "; {}", out.display());
    line
}

/// Bits per second of a rate as the script takes it (`100mbit`, `1gbit`, ...).
fn rate_bits(rate: &str) -> Option<f64> {
    let r = rate.to_ascii_lowercase();
    let end = r.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(r.len());
    let n: f64 = r[..end].parse().ok()?;
    let unit = r[end..].trim_end_matches("/s");
    let f = match unit {
        "bit" | "" => 1.0,
        "kbit" => 1e3,
        "mbit" => 1e6,
        "gbit" => 1e9,
        _ => return None,
    };
    Some(n * f)
}

// ---------------------------------------------------------------- probe

fn build_bandwidth_example() -> Result<PathBuf, String> {
    let mut c = cargo();
    c.args(["build", "--locked", "--release", "-p", "zeropp-comm", "--features", "mpi"]);
    c.args(["--example", "mpi_bandwidth"]);
    run_step("build mpi_bandwidth", c)?;
    Ok(target_dir().join("release/examples/mpi_bandwidth"))
}

/// Achieved node-to-node bandwidth (bytes/s) through MPI at `rate`.
fn measure_bandwidth(bin: &Path, rate: &str, out: &Path, bidi: bool) -> Result<f64, String> {
    let bits = rate_bits(rate).ok_or_else(|| format!("probe: cannot read the rate `{rate}`"))?;
    // About 3 s of traffic at the configured rate.
    let total = (bits / 8.0 * 3.0).max(8.0 * 1024.0 * 1024.0);
    // 1 MiB messages: below the cluster's eager limit (4 MiB), as in training.
    let msg = 1usize << 20;
    let reps = ((total / msg as f64).ceil() as usize).max(2);
    let shape = Shape::new(2, 1, rate);
    let mut args = vec![msg.to_string(), reps.to_string()];
    if bidi {
        args.push("bidi".into());
    }
    let o = launch(&shape, out, &Launch { time_limit_s: 120, ..Launch::default() }, bin, &args, false)?;
    if !o.success {
        return Err(format!("probe at {rate} failed:\n{}", tail(&o.log, 20)));
    }
    o.log
        .split("bandwidth_bytes_per_s=")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("probe at {rate}: no bandwidth in the output:\n{}", tail(&o.log, 20)))
}

fn probe(args: &[String]) -> Result<(), String> {
    let mut rates = vec!["100mbit".to_string(), "1gbit".to_string()];
    let mut i = 0;
    while i < args.len() {
        match args[i].as_str() {
            "--rates" => rates = value(args, &mut i, "--rates")?.split(',').map(String::from).collect(),
            other => return Err(format!("cluster probe: unknown option `{other}`")),
        }
        i += 1;
    }
    let bin = build_bandwidth_example()?;
    let mut worst: f64 = f64::INFINITY;
    for rate in &rates {
        let out = target_dir().join("cluster/probe").join(rate);
        let configured = rate_bits(rate).unwrap_or(f64::NAN) / 8.0;
        for (what, bidi) in [("one way", false), ("both ways at once, per direction", true)] {
            let achieved = measure_bandwidth(&bin, rate, &out, bidi)?;
            let ratio = achieved / configured;
            worst = worst.min(ratio);
            println!(
                "probe {rate}, {what}: achieved {:.2} MB/s of configured {:.2} MB/s: achieved/configured {ratio:.3}",
                achieved / 1e6,
                configured / 1e6
            );
        }
    }
    if worst >= 0.9 {
        println!("probe: every rate reaches >= 0.9 of its configuration");
    } else {
        println!("probe: worst achieved/configured {worst:.3} (< 0.9, the goal)");
    }
    Ok(())
}

fn tail(log: &str, n: usize) -> String {
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

// ---------------------------------------------------------------- clean

fn clean() -> Result<(), String> {
    let out = Command::new("ip").args(["netns", "list"]).output().map_err(|e| format!("ip: {e}"))?;
    let list = String::from_utf8_lossy(&out.stdout);
    let mut removed = 0;
    for name in list.lines().filter_map(|l| l.split_whitespace().next()) {
        // zpp-<pid hex + 2 random hex digits, last 6>-...: only namespaces with no process left.
        if !name.starts_with("zpp-") {
            continue;
        }
        let pids = Command::new("ip").args(["netns", "pids", name]).output().map_err(|e| e.to_string())?;
        if !String::from_utf8_lossy(&pids.stdout).trim().is_empty() {
            continue;
        }
        let del = Command::new("ip").args(["netns", "del", name]).status().map_err(|e| e.to_string())?;
        if del.success() {
            removed += 1;
        }
    }
    println!("cluster clean: removed {removed} idle zpp-* namespaces");
    Ok(())
}

// ---------------------------------------------------------------- tests

/// Why the cluster tests cannot run here, if they cannot.
fn missing_prerequisite() -> Option<String> {
    let uid = Command::new("id")
        .arg("-u")
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
    if uid.as_deref() != Some("0") {
        return Some("not root (network namespaces need root)".into());
    }
    if !crate::has_mpirun() {
        return Some("no `mpirun` (apt-get install openmpi-bin libopenmpi-dev)".into());
    }
    for tool in ["ip", "tc"] {
        if Command::new(tool).arg("-V").output().map(|o| !o.status.success()).unwrap_or(true) {
            return Some(format!("no `{tool}` (apt-get install iproute2)"));
        }
    }
    let name = format!("zpp-probe-{}", std::process::id());
    let ok = Command::new("ip").args(["netns", "add", &name]).status().map(|s| s.success()).unwrap_or(false);
    if !ok {
        return Some("cannot create a network namespace (`ip netns add` failed)".into());
    }
    let _ = Command::new("ip").args(["netns", "del", &name]).status();
    None
}

/// One test's verdict, printed as it comes.
struct Tally {
    passed: usize,
    failed: Vec<String>,
}

impl Tally {
    fn check(&mut self, name: &str, result: Result<String, String>) {
        match result {
            Ok(detail) => {
                self.passed += 1;
                println!("ok   {name}: {detail}");
            }
            Err(why) => {
                println!("FAIL {name}: {why}");
                self.failed.push(name.into());
            }
        }
    }
}

/// Compares two metrics files step by step: losses, gradient norms and byte counters bitwise.
fn same_losses(a: &Path, b: &Path) -> Result<String, String> {
    let (sa, ua) = read_metrics(a)?;
    let (sb, ub) = read_metrics(b)?;
    if sa.is_empty() || sa.len() != sb.len() {
        return Err(format!("step counts differ or are zero: {} vs {}", sa.len(), sb.len()));
    }
    for (x, y) in sa.iter().zip(&sb) {
        for k in
            ["step", "loss", "grad_norm", "skipped", "inter_node_bytes", "intra_node_bytes", "bytes_by_op"]
        {
            if x.get(k) != y.get(k) {
                return Err(format!(
                    "step {:?}: {k} differs: {:?} vs {:?}",
                    x.get("step"),
                    x.get(k),
                    y.get(k)
                ));
            }
        }
    }
    if ua.get("final_loss") != ub.get("final_loss") {
        return Err("final losses differ".into());
    }
    Ok(format!(
        "{} steps bitwise equal, final loss {}",
        sa.len(),
        ua.get("final_loss").unwrap_or(&Value::Null)
    ))
}

/// A threads run of `zeropp` with the same arguments as a cluster run.
fn threads_run(
    zeropp: &Path,
    shape: &Shape,
    args: &[String],
    metrics: &Path,
    link: Option<&str>,
) -> Result<(), String> {
    let mut c = Command::new(zeropp);
    c.args(["train", "--backend", "threads", "--world", &shape.world().to_string()]);
    c.args(["--local-size", &shape.local_size.to_string()]).args(args).arg("--metrics").arg(metrics);
    if let Some(l) = link {
        c.args(["--link", l]);
    }
    let o = c.output().map_err(|e| format!("{}: {e}", zeropp.display()))?;
    if o.status.success() {
        Ok(())
    } else {
        Err(format!("threads run failed: {}", tail(&String::from_utf8_lossy(&o.stderr), 10)))
    }
}

fn train_args(shape: &Shape, mode_args: &[&str], common: &[&str], metrics: &Path) -> Vec<String> {
    let mut v: Vec<String> = vec!["train".into(), "--backend".into(), "mpi".into()];
    v.extend(["--local-size".into(), shape.local_size.to_string()]);
    v.extend(mode_args.iter().chain(common).map(|s| s.to_string()));
    v.extend(["--metrics".into(), metrics.display().to_string()]);
    v
}

/// Trains with `mode_args` and `common` on `shape` (the `zeropp` binary under
/// MPI, launched with `opts`) into `out`; returns the outcome and the metrics file.
fn train(
    shape: &Shape,
    out: &Path,
    (mode_args, common): (&[&str], &[&str]),
    opts: &Launch,
    zeropp: &Path,
) -> Result<(Outcome, PathBuf), String> {
    let metrics = out.join("metrics.jsonl");
    let targs = train_args(shape, mode_args, common, &metrics);
    Ok((launch(shape, out, opts, zeropp, &targs, false)?, metrics))
}

/// `cargo xtask test-cluster [--full] [--faults]`.
pub(crate) fn test(args: &[String]) -> Result<(), String> {
    let full = args.iter().any(|a| a == "--full");
    let faults = args.iter().any(|a| a == "--faults");
    let required = std::env::var("CI").is_ok_and(|v| v == "true")
        || std::env::var("ZEROPP_REQUIRE_CLUSTER").is_ok_and(|v| v == "1");
    if let Some(why) = missing_prerequisite() {
        if required {
            return Err(format!(
                "cluster tests cannot run: {why} (CI=true / ZEROPP_REQUIRE_CLUSTER=1 forbid a skip)"
            ));
        }
        println!("SKIP 1 test group: cluster tests: {why}");
        return Ok(());
    }
    let zeropp = build_zeropp(false)?;
    let base = target_dir().join("cluster/tests");
    let _ = std::fs::remove_dir_all(&base);
    let mut t = Tally { passed: 0, failed: Vec::new() };

    // gpt-medium (2.4 M parameters), a few steps: messages of hundreds of kB, so neither
    // the headers nor the job's fixed start-up traffic (OpenMPI's wire-up, ~0.1 MB)
    // dominate the kernel's count.
    let common =
        ["--model", "gpt-medium", "--steps", "3", "--seed", "3", "--eval-batches", "0", "--batch", "8"];
    let mut shapes = vec![Shape::new(2, 2, "1gbit")];
    if full {
        shapes.push(Shape::new(2, 4, "1gbit"));
    }
    let mut zero3_kernel = None;
    for shape in &shapes {
        for (mode, mode_args) in [("zero3", &["--mode", "zero3"][..]), ("zeropp", &["--mode", "zeropp"][..])]
        {
            let tag = format!("{}x{} {mode}", shape.nodes, shape.local_size);
            let out = base.join(format!("{}x{}-{mode}", shape.nodes, shape.local_size));
            let opts = Launch { time_limit_s: 300, ..Launch::default() };
            let (o, metrics) = train(shape, &out, (mode_args, &common), &opts, &zeropp)?;
            if !o.success {
                t.check(
                    &format!("{tag}: cluster run"),
                    Err(format!("exit {:?}\n{}", o.code, tail(&o.log, 25))),
                );
                continue;
            }
            let reference = out.join("threads.jsonl");
            let targs_threads: Vec<String> = mode_args.iter().chain(&common).map(|s| s.to_string()).collect();
            let equal = threads_run(&zeropp, shape, &targs_threads, &reference, None)
                .and_then(|()| same_losses(&metrics, &reference));
            t.check(&format!("{tag}: losses mpi-over-tcp == threads"), equal);
            let counted = (|| {
                let (steps, _) = read_metrics(&metrics)?;
                let project = project_inter(&steps, shape.world());
                let kernel = kernel_tx(&out)?;
                let ratio = kernel / project;
                let detail =
                    format!("kernel tx {kernel:.0} B / project inter-node {project:.0} B = {ratio:.3}");
                if mode == "zero3" {
                    zero3_kernel = Some(kernel);
                } else if let Some(z3) = zero3_kernel {
                    let r = kernel / z3;
                    let verdict =
                        format!("kernel-measured ZeRO++/ZeRO-3 cross-node bytes {r:.3} (goal <= 0.27)");
                    t.check(
                        &format!("{}x{}: ZeRO++/ZeRO-3 on the wire", shape.nodes, shape.local_size),
                        if r <= 0.27 { Ok(verdict) } else { Err(verdict) },
                    );
                }
                if (1.0..=1.25).contains(&ratio) {
                    Ok(detail)
                } else {
                    Err(format!("{detail}: outside [1.0, 1.25]"))
                }
            })();
            t.check(&format!("{tag}: kernel bytes vs project counters"), counted);
        }
    }

    // Which transport each pair used: vader within a node, tcp across.
    let shape = Shape::new(2, 2, "1gbit");
    let out = base.join("transport");
    let args =
        (&["--mode", "zeropp"][..], &["--model", "gpt-tiny", "--steps", "1", "--eval-batches", "0"][..]);
    let opts = Launch { time_limit_s: 120, btl_verbose: true, ..Launch::default() };
    let (o, _) = train(&shape, &out, args, &opts, &zeropp)?;
    t.check(
        "transport per pair (btl_base_verbose)",
        if o.success { transports(&o.log) } else { Err(tail(&o.log, 20)) },
    );

    if faults {
        fault_tests(&zeropp, &base, &mut t)?;
    }

    let leftovers = Command::new("ip")
        .args(["netns", "list"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).to_string())
        .unwrap_or_default();
    let left: Vec<&str> = leftovers.lines().filter(|l| l.starts_with("zpp-")).collect();
    t.check(
        "namespaces torn down",
        if left.is_empty() { Ok("no zpp-* namespace left".into()) } else { Err(format!("left: {left:?}")) },
    );

    println!("cluster tests: {} passed, {} failed", t.passed, t.failed.len());
    if t.failed.is_empty() { Ok(()) } else { Err(format!("cluster tests failed: {}", t.failed.join("; "))) }
}

/// Reads OpenMPI's `mca: bml: Using BTL btl for send to [[job,1],PEER] on node NODE`
/// lines (`[HOST:pid]` prefix): every pair on one host must use vader, every pair
/// across hosts tcp.
fn transports(log: &str) -> Result<String, String> {
    let mut same = (0, 0);
    let mut across = (0, 0);
    for line in log.lines().filter(|l| l.contains("mca: bml: Using")) {
        let host = line.trim_start_matches('[').split(':').next().unwrap_or("");
        let btl = line.split("Using ").nth(1).and_then(|s| s.split_whitespace().next()).unwrap_or("");
        let node = line.rsplit("on node ").next().unwrap_or("").trim();
        if btl == "self" {
            continue;
        }
        if node_index(host).is_some() && node_index(host) == node_index(node) {
            if btl == "vader" { same.0 += 1 } else { same.1 += 1 }
        } else if btl == "tcp" {
            across.0 += 1
        } else {
            across.1 += 1
        }
    }
    let detail = format!(
        "within a node: {} pairs vader, {} other; across nodes: {} pairs tcp, {} other",
        same.0, same.1, across.0, across.1
    );
    if same.0 > 0 && across.0 > 0 && same.1 == 0 && across.1 == 0 { Ok(detail) } else { Err(detail) }
}

/// The node of an OpenMPI node name: the host name `zpp-ID-nI`, or the hostfile's
/// address `A.B.C.(I+1)` (OpenMPI names remote nodes by their hostfile entry).
fn node_index(name: &str) -> Option<usize> {
    if let Some((_, i)) = name.rsplit_once("-n") {
        return i.parse().ok();
    }
    name.rsplit('.').next()?.parse::<usize>().ok()?.checked_sub(1)
}

// ---------------------------------------------------------------- faults

fn fault_tests(zeropp: &Path, base: &Path, t: &mut Tally) -> Result<(), String> {
    let common = ["--model", "gpt-tiny", "--seed", "5", "--eval-batches", "0"];
    let shape = Shape::new(2, 2, "100mbit");
    let timeout_s = 10u64;

    // 1% loss: same losses as the lossless run.
    let mut lossy = shape.clone();
    lossy.loss = Some("1".into());
    let out = base.join("loss");
    let m_loss = out.join("metrics.jsonl");
    let targs = train_args(&lossy, &["--mode", "zeropp", "--steps", "10"], &common, &m_loss);
    let o = launch(&lossy, &out, &Launch { time_limit_s: 300, ..Launch::default() }, zeropp, &targs, false)?;
    let reference = out.join("threads.jsonl");
    let verdict = if o.success {
        threads_run(
            zeropp,
            &shape,
            &["--mode".into(), "zeropp".into(), "--steps".into(), "10".into()]
                .into_iter()
                .chain(common.iter().map(|s| s.to_string()))
                .collect::<Vec<_>>(),
            &reference,
            None,
        )
        .and_then(|()| same_losses(&m_loss, &reference))
        .and_then(|d| {
            let drops: Vec<&str> = o.log.lines().filter(|l| l.contains("dropped")).collect();
            if drops.is_empty() || drops.iter().any(|l| l.contains("packets 0 ") || l.contains("? packets")) {
                Err(format!("no packet was dropped: {drops:?}"))
            } else {
                Ok(format!("{d} ({:.1} s); {}", o.wall_s, drops.join("; ")))
            }
        })
    } else {
        Err(tail(&o.log, 20))
    };
    t.check("1% packet loss: losses equal the lossless run", verdict);

    // Link down mid-run: an error within --timeout, and the last checkpoint resumes bitwise.
    let out = base.join("linkdown");
    let ckpt = out.join("ckpt");
    let m = out.join("metrics.jsonl");
    // Far more steps than 6 s allow (gpt-tiny takes milliseconds a step): the fault ends it.
    let steps = ["--mode", "zeropp", "--steps", "1000000", "--save-every", "100", "--timeout", "10"];
    let mut targs = train_args(&shape, &steps, &common, &m);
    targs.extend(["--save".into(), ckpt.display().to_string()]);
    // The bound: the fault at 6 s, --timeout for rank 0's watchdog, the cluster's 15 s
    // grace for mpirun to end the job, and 10 s of start-up and slack.
    let bound = 6 + timeout_s + 15 + 10;
    let limit = bound + 60;
    let o = launch(
        &shape,
        &out,
        &Launch { time_limit_s: limit, fault: Some("linkdown:1:6".into()), ..Launch::default() },
        zeropp,
        &targs,
        false,
    )?;
    let named = o.log.lines().find(|l| l.contains("fatal:")).unwrap_or("").trim().to_string();
    let verdict = if o.success {
        Err("the run succeeded although node 1's link went down".into())
    } else if o.wall_s > bound as f64 {
        Err(format!("ended after {:.0} s, past the bound of {bound} s", o.wall_s))
    } else if named.is_empty() {
        Err(format!("no error message naming the failure:\n{}", tail(&o.log, 15)))
    } else {
        Ok(format!(
            "ended after {:.1} s (bound {bound} s: link down at 6 s, --timeout {timeout_s}, 15 s grace), {}: {named}",
            o.wall_s,
            ended_by(&o.log)
        ))
    };
    t.check("link down mid-run: error within the bound", verdict);
    // Resume the last committed checkpoint on the thread backend, and compare with an
    // uninterrupted run to the same step.
    let resumed = (|| {
        let saved = read_metrics(&m).map(|(s, _)| s.len()).unwrap_or(0);
        // The checkpoint is at or before the last step with metrics: resume past that.
        let resume_to = saved + 50;
        let r_out = out.join("resumed.jsonl");
        let full_out = out.join("full.jsonl");
        let mut a: Vec<String> = ["--mode", "zeropp", "--steps", &resume_to.to_string()]
            .iter()
            .chain(&common)
            .map(|s| s.to_string())
            .collect();
        let plain = a.clone();
        a.extend(["--resume".into(), ckpt.display().to_string()]);
        threads_run(zeropp, &shape, &a, &r_out, None)?;
        threads_run(zeropp, &shape, &plain, &full_out, None)?;
        let (rs, ru) = read_metrics(&r_out)?;
        let (fs, fu) = read_metrics(&full_out)?;
        let first = rs
            .first()
            .and_then(|s| s.get("step"))
            .and_then(Value::as_u64)
            .ok_or("the resumed run has no steps")?;
        for r in &rs {
            let step = r.get("step").and_then(Value::as_u64).unwrap_or(u64::MAX);
            let f = fs.get(step as usize).ok_or("step missing in the full run")?;
            if r.get("loss") != f.get("loss") {
                return Err(format!(
                    "step {step}: loss {:?} vs uninterrupted {:?}",
                    r.get("loss"),
                    f.get("loss")
                ));
            }
        }
        if ru.get("final_loss") != fu.get("final_loss") {
            return Err("final losses differ".into());
        }
        Ok(format!(
            "resumed at step {first} (metrics of {saved} steps written before the fault), {} steps bitwise equal to the uninterrupted run",
            rs.len()
        ))
    })();
    t.check("link down: the last checkpoint resumes bitwise", resumed);

    // Every rank of node 1 killed: the job ends with an error, node 0's ranks exit.
    let out = base.join("killnode");
    let m = out.join("metrics.jsonl");
    let targs =
        train_args(&shape, &["--mode", "zeropp", "--steps", "1000000", "--timeout", "10"], &common, &m);
    let o = launch(
        &shape,
        &out,
        &Launch { time_limit_s: 120, fault: Some("killnode:1:6".into()), ..Launch::default() },
        zeropp,
        &targs,
        false,
    )?;
    // Bound: the fault at 6 s, the 15 s grace, 10 s of start-up and slack.
    let verdict = if o.success {
        Err("the run succeeded although node 1's ranks were killed".into())
    } else if o.wall_s > 31.0 {
        Err(format!("ended after {:.0} s, past the bound of 31 s", o.wall_s))
    } else if !o.log.contains("exited on signal 9") {
        Err(format!("no message naming the killed ranks:\n{}", tail(&o.log, 15)))
    } else {
        let line = o.log.lines().find(|l| l.contains("exited on signal")).unwrap_or("").trim().to_string();
        Ok(format!("ended after {:.1} s, exit {:?}, {}: {line}", o.wall_s, o.code, ended_by(&o.log)))
    };
    t.check("every rank of node 1 killed: the job ends with an error", verdict);
    Ok(())
}

/// Who ended a failed job: mpirun itself, or the cluster's reaper after the grace period.
fn ended_by(log: &str) -> &'static str {
    if log.contains("was still running") { "ended by the cluster's reaper" } else { "ended by mpirun" }
}

// ---------------------------------------------------------------- bench

/// `cargo xtask bench cluster`: see the module doc.
pub(crate) fn bench(report_dir: &Path) -> Result<(), String> {
    if let Some(why) = missing_prerequisite() {
        return Err(format!("bench cluster cannot run: {why}"));
    }
    let zeropp = build_zeropp(true)?;
    let rates: Vec<String> = std::env::var("ZEROPP_CLUSTER_RATES")
        .unwrap_or_else(|_| "10mbit,50mbit,200mbit,1gbit,unshaped".into())
        .split(',')
        .map(String::from)
        .collect();
    let model = std::env::var("ZEROPP_CLUSTER_MODEL").unwrap_or_else(|_| "gpt-medium".into());
    let variants: [(&str, &[&str]); 5] = [
        ("ZeRO-3", &["--mode", "zero3"]),
        ("qwZ", &["--mode", "zero3", "--qwz"]),
        ("hpZ", &["--mode", "zero3", "--hpz", "2"]),
        ("qgZ", &["--mode", "zero3", "--qgz"]),
        ("ZeRO++", &["--mode", "zeropp"]),
    ];
    let base = target_dir().join("cluster/bench");
    let _ = std::fs::remove_dir_all(&base);
    let shape0 = Shape::new(2, 2, "unshaped");
    // rows[rate][variant] = (measured step s, predicted step s)
    let mut rows: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
    let mut params = 0.0;
    for rate in &rates {
        // Slow rates: seconds per step, 3 steps; fast ones: 12 (the first is left out).
        let steps = if rate_bits(rate).is_some_and(|b| b < 100e6) { "3" } else { "12" };
        let common = [
            "--model",
            model.as_str(),
            "--steps",
            steps,
            "--seed",
            "1",
            "--eval-batches",
            "0",
            "--batch",
            "4",
        ];
        let mut row = Vec::new();
        for (name, margs) in variants {
            let mut shape = shape0.clone();
            shape.rate = rate.clone();
            let out = base.join(rate).join(name.replace('+', "p"));
            let opts = Launch { time_limit_s: 600, ..Launch::default() };
            let (o, metrics) = train(&shape, &out, (margs, &common), &opts, &zeropp)?;
            if !o.success {
                return Err(format!("bench cluster: {name} at {rate} failed:\n{}", tail(&o.log, 20)));
            }
            let (msteps, summary) = read_metrics(&metrics)?;
            params = summary.get("params").and_then(Value::as_f64).unwrap_or(params);
            let measured = steady_step_time(&msteps);
            // The link model of the same configuration on the thread backend.
            let predicted_path = out.join("model.jsonl");
            let link = link_for(rate, shape.local_size);
            let args: Vec<String> = margs.iter().chain(&common).map(|s| s.to_string()).collect();
            threads_run(&zeropp, &shape, &args, &predicted_path, Some(&link))?;
            let (psteps, _) = read_metrics(&predicted_path)?;
            let predicted = steady_step_time(&psteps);
            eprintln!(
                "bench cluster: {rate} {name}: measured {measured:.3} s/step, link model {predicted:.3} s/step"
            );
            row.push((measured, predicted));
        }
        rows.push((rate.clone(), row));
    }
    let md = bench_report(&rows, &variants.iter().map(|v| v.0).collect::<Vec<_>>(), params, &model);
    let out = report_dir.join("cluster.md");
    std::fs::write(&out, &md).map_err(|e| format!("{}: {e}", out.display()))?;
    let csv = report_dir.join("cluster.csv");
    let mut c = String::from("rate_bits,variant,measured_s,predicted_s\n");
    for (rate, row) in &rows {
        for ((m, p), name) in row.iter().zip(variants.iter().map(|v| v.0)) {
            let _ = writeln!(c, "{},{name},{m},{p}", rate_bits(rate).unwrap_or(0.0));
        }
    }
    std::fs::write(&csv, c).map_err(|e| format!("{}: {e}", csv.display()))?;
    let svg = report_dir.join("cluster-speedup.svg");
    plot_speedup(&rows, &variants.iter().map(|v| v.0).collect::<Vec<_>>(), &svg)
        .map_err(|e| format!("{}: {e}", svg.display()))?;
    println!("{md}");
    eprintln!("==> wrote {}, {} and {}", out.display(), csv.display(), svg.display());
    Ok(())
}

/// The `--link` of the thread backend for a cluster rate, with the two corrections
/// the measurements asked for (see `LinkModel::parse`): the node's ranks share one
/// uplink (`inter_share`), and tbf counts Ethernet frames, of which TCP payload is 0.956
/// (`inter_framing=tcp`, what `cluster probe` measures one way).
/// `ZEROPP_CLUSTER_LINK=naive` leaves both out. Unshaped: the 1.2 Gbit/s order of
/// magnitude of the unshaped probe.
fn link_for(rate: &str, local_size: usize) -> String {
    let naive = std::env::var("ZEROPP_CLUSTER_LINK").is_ok_and(|v| v == "naive");
    let bits = rate_bits(rate).unwrap_or(1.2e9);
    let fix = if naive { String::new() } else { format!(",inter_share={local_size},inter_framing=tcp") };
    format!("intra=10GB/s,inter={bits}bit/s,latency=0{fix}")
}

/// Median step time without the first step (warm-up: connection set-up, allocation).
fn steady_step_time(steps: &[Value]) -> f64 {
    let mut t: Vec<f64> =
        steps.iter().skip(1).filter_map(|s| s.get("step_time_s").and_then(Value::as_f64)).collect();
    t.sort_by(f64::total_cmp);
    match t.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => t[n / 2],
        n => (t[n / 2 - 1] + t[n / 2]) / 2.0,
    }
}

fn bench_report(rows: &[(String, Vec<(f64, f64)>)], names: &[&str], params: f64, model: &str) -> String {
    let mut md = String::new();
    let _ = writeln!(md, "# bench `cluster`\n");
    let _ = writeln!(
        md,
        "2 nodes x 2 ranks (network namespaces, OpenMPI over TCP between nodes, shared memory within), \
         model `{model}` ({:.2} M parameters), global batch 4, median step time of 3 steps (below \
         100 Mbit/s) or 12 (the first left out), no added delay. \
         Machine: {}.\n",
        params / 1e6,
        crate::machine()
    );
    let _ =
        writeln!(md, "Step-time speedup over ZeRO-3 at the same rate (measured; link model in brackets):\n");
    let _ = write!(md, "| inter-node rate | ZeRO-3 s/step |");
    for n in &names[1..] {
        let _ = write!(md, " {n} |");
    }
    let _ = writeln!(md);
    let _ = writeln!(md, "|---|---|{}", "---|".repeat(names.len() - 1));
    for (rate, row) in rows {
        let (z3m, z3p) = row[0];
        let _ = write!(md, "| {rate} | {z3m:.3} ({z3p:.3}) |");
        for &(m, p) in &row[1..] {
            let _ = write!(md, " {:.2}x ({:.2}x) |", z3m / m, z3p / p);
        }
        let _ = writeln!(md);
    }
    let _ = writeln!(md, "\nMeasured / link-model step time:\n");
    let _ = write!(md, "| inter-node rate |");
    for n in names {
        let _ = write!(md, " {n} |");
    }
    let _ = writeln!(md);
    let _ = writeln!(md, "|---|{}", "---|".repeat(names.len()));
    for (rate, row) in rows {
        let _ = write!(md, "| {rate} |");
        for &(m, p) in row {
            let _ = write!(md, " {:.2} |", m / p);
        }
        let _ = writeln!(md);
    }
    md
}

/// Speedup over ZeRO-3 against the inter-node bandwidth (log scale), one colour per
/// variant: measured solid, link model dashed. Unshaped rows have no bandwidth and are
/// left out.
fn plot_speedup(rows: &[(String, Vec<(f64, f64)>)], names: &[&str], path: &Path) -> Result<(), String> {
    use plotters::prelude::*;
    let e = |x: &dyn std::fmt::Display| x.to_string();
    let pts: Vec<(f64, &Vec<(f64, f64)>)> =
        rows.iter().filter_map(|(r, row)| rate_bits(r).map(|b| (b / 1e6, row))).collect();
    if pts.is_empty() {
        return Err("no shaped rate to plot".into());
    }
    let (lo, hi) = pts.iter().fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.0), b.max(p.0)));
    let top = pts
        .iter()
        .flat_map(|(_, row)| row.iter().map(move |&(m, p)| (row[0].0 / m).max(row[0].1 / p)))
        .fold(1.0f64, f64::max);
    let root = SVGBackend::new(path, (900, 540)).into_drawing_area();
    root.fill(&WHITE).map_err(|x| e(&x))?;
    let mut chart = ChartBuilder::on(&root)
        .caption("speedup over ZeRO-3 vs inter-node bandwidth (2 nodes x 2, TCP)", ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(56)
        .build_cartesian_2d((lo * 0.8..hi * 1.25).log_scale(), 0.0..top * 1.1)
        .map_err(|x| e(&x))?;
    chart
        .configure_mesh()
        .x_desc("inter-node rate per node uplink (Mbit/s)")
        .y_desc("step-time speedup over ZeRO-3")
        .draw()
        .map_err(|x| e(&x))?;
    for (i, name) in names.iter().enumerate().skip(1) {
        let color = Palette99::pick(i).to_rgba();
        let measured: Vec<(f64, f64)> = pts.iter().map(|(x, row)| (*x, row[0].0 / row[i].0)).collect();
        let model: Vec<(f64, f64)> = pts.iter().map(|(x, row)| (*x, row[0].1 / row[i].1)).collect();
        chart
            .draw_series(LineSeries::new(measured, color.stroke_width(2)))
            .map_err(|x| e(&x))?
            .label(format!("{name} (measured)"))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2)));
        chart
            .draw_series(DashedLineSeries::new(model, 6, 4, color.stroke_width(1)))
            .map_err(|x| e(&x))?
            .label(format!("{name} (link model)"))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(1)));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|x| e(&x))?;
    root.present().map_err(|x| e(&x))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_read_as_tc_writes_them() {
        assert_eq!(rate_bits("100mbit"), Some(100e6));
        assert_eq!(rate_bits("1gbit"), Some(1e9));
        assert_eq!(rate_bits("1Gbit/s"), Some(1e9));
        assert_eq!(rate_bits("12.5kbit"), Some(12.5e3));
        assert_eq!(rate_bits("unshaped"), None);
        assert_eq!(rate_bits("10MB/s"), None, "bytes per second are not a tc rate here");
    }

    #[test]
    fn nodes_are_named_by_host_name_or_hostfile_address() {
        assert_eq!(node_index("zpp-0555b0f-n0"), Some(0));
        assert_eq!(node_index("zpp-0555b0f-n12"), Some(12));
        assert_eq!(node_index("10.217.188.2"), Some(1));
        assert_eq!(node_index("vm"), None);
    }

    /// Lines as OpenMPI 4.1 prints them with `btl_base_verbose` (from a 2 x 2 run).
    const BML: &str = "\
[zpp-0555b0f-n0:21946] mca: bml: Using vader btl for send to [[46993,1],1] on node zpp-0555b0f-n0
[zpp-0555b0f-n0:21946] mca: bml: Using self btl for send to [[46993,1],0] on node zpp-0555b0f-n0
[zpp-0555b0f-n1:21952] mca: bml: Using vader btl for send to [[46993,1],3] on node 10.217.188.2
[zpp-0555b0f-n1:21952] mca: bml: Using tcp btl for send to [[46993,1],0] on node zpp-0555b0f-n0
[zpp-0555b0f-n0:21946] mca: bml: Using tcp btl for send to [[46993,1],2] on node 10.217.188.2
";

    #[test]
    fn transports_vader_within_tcp_across() {
        assert_eq!(
            transports(BML),
            Ok("within a node: 2 pairs vader, 0 other; across nodes: 2 pairs tcp, 0 other".into())
        );
        // tcp inside a node, or vader across nodes, fails.
        let wrong = BML
            .replace("Using vader btl for send to [[46993,1],3]", "Using tcp btl for send to [[46993,1],3]");
        assert!(transports(&wrong).is_err());
        let wrong = BML
            .replace("Using tcp btl for send to [[46993,1],0]", "Using vader btl for send to [[46993,1],0]");
        assert!(transports(&wrong).is_err());
        assert!(transports("").is_err(), "no bml lines at all is a failure");
    }

    #[test]
    fn steady_step_time_is_the_median_after_the_first_step() {
        let steps: Vec<Value> =
            [9.0, 1.0, 3.0, 2.0].iter().map(|t| serde_json::json!({ "step_time_s": t })).collect();
        assert_eq!(steady_step_time(&steps), 2.0);
        assert_eq!(steady_step_time(&steps[..3]), 2.0);
        assert!(steady_step_time(&steps[..1]).is_nan());
    }

    #[test]
    fn the_link_model_shares_the_uplink_and_pays_tcp_framing() {
        assert_eq!(
            link_for("100mbit", 2),
            "intra=10GB/s,inter=100000000bit/s,latency=0,inter_share=2,inter_framing=tcp"
        );
    }
}
