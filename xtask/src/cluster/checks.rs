//! What the cluster test suites share (`test.rs` and its fault tests in
//! `faults.rs`): the verdict tally, the bitwise comparison of two runs'
//! metrics, and the threads run and MPI arguments a cluster run is compared with.

use std::path::Path;
use std::process::Command;

use serde_json::Value;

use super::{Shape, read_metrics, tail};

/// One test's verdict, printed as it comes.
pub(super) struct Tally {
    pub(super) passed: usize,
    pub(super) failed: Vec<String>,
}

impl Tally {
    pub(super) fn check(&mut self, name: &str, result: Result<String, String>) {
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
pub(super) fn same_losses(a: &Path, b: &Path) -> Result<String, String> {
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
pub(super) fn threads_run(
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

/// The arguments of `zeropp train` under MPI on `shape`, writing `metrics`.
pub(super) fn train_args(shape: &Shape, mode_args: &[&str], common: &[&str], metrics: &Path) -> Vec<String> {
    let mut v: Vec<String> = vec!["train".into(), "--backend".into(), "mpi".into()];
    v.extend(["--local-size".into(), shape.local_size.to_string()]);
    v.extend(mode_args.iter().chain(common).map(|s| s.to_string()));
    v.extend(["--metrics".into(), metrics.display().to_string()]);
    v
}
