//! Everything `zeropp train` and `zeropp compare` print, for both backends:
//! the DeepSpeed config warnings, the data and plan lines, the progress bar,
//! the summary table and the memory line (the engine keeps the data,
//! [`Summary`]; its presentation is the binary's).

use std::path::Path;

use indicatif::{ProgressBar, ProgressStyle};
use zeropp_engine::data::DataInfo;
use zeropp_engine::metrics::{StepRecord, Summary};
use zeropp_engine::{Backend, Model, RunConfig, Started};

/// Prints the warnings of an imported DeepSpeed config to stderr.
pub(crate) fn print_warnings(warnings: &[String]) {
    for w in warnings {
        eprintln!("warning: DeepSpeed config: {w}");
    }
}

/// Prints what the data is and, when known, its loss floor.
pub(crate) fn print_data(info: &DataInfo) {
    println!("data: {} (vocab {}, {} training tokens)", info.description, info.vocab, info.train_tokens);
    if let Some(h) = info.entropy_rate {
        println!("entropy rate of the source (the loss floor): {h:.4} nats/char");
    }
}

/// Prints what is about to run: `model` (as given on the command line), the
/// ZeRO mode, the cluster it `started` on and the schedule of `run`.
pub(crate) fn print_plan(model: &str, run: &RunConfig, started: &Started) {
    let t = &started.topology;
    let ran = run.on_job(t.world(), t.local_size());
    let threads =
        format!("{} compute thread{} per rank", started.threads, if started.threads == 1 { "" } else { "s" });
    let (ranks, level) = match (started.backend, &started.mpi_thread_level) {
        (Backend::Mpi, Some(l)) => ("MPI ranks", format!(", MPI {l}, {threads}")),
        (Backend::Mpi, None) => ("MPI ranks", format!(", {threads}")),
        _ => ("ranks", String::new()),
    };
    let launcher = started.job.as_ref().map_or_else(String::new, |j| format!(" under {}", j.launcher));
    println!(
        "training {model:?} with {} on {} {ranks} = {} nodes x {}{launcher} ({} steps, global batch {}{level})",
        ran.engine.zero.label(),
        t.world(),
        t.nodes(),
        t.local_size(),
        ran.steps,
        ran.engine.global_batch,
    );
}

/// Prints the summary of a finished run and where its metrics were written.
pub(crate) fn print_report(summary: &Summary, metrics: Option<&Path>) {
    println!();
    print!("{}", format_summary(summary));
    if let Some(m) = metrics {
        println!("metrics written to {}", m.display());
    }
}

fn fmt_bytes(b: f64) -> String {
    if b >= 1e6 {
        format!("{:.3} MB", b / 1e6)
    } else if b >= 1e3 {
        format!("{:.2} kB", b / 1e3)
    } else {
        format!("{b:.0} B")
    }
}

/// A human-readable table of a summary (what `zeropp train` prints at the end).
fn format_summary(s: &Summary) -> String {
    let mut out = String::new();
    let val = s.val_loss.map_or_else(|| "-".to_string(), |v| format!("{v:.4}"));
    out.push_str(&format!(
        "model {} ({} params), {} ranks = {} nodes x {}, mode {} (baseline comm {})\n",
        s.model,
        s.params,
        s.world,
        s.world / s.local_size.max(1),
        s.local_size,
        s.mode,
        s.comm_dtype
    ));
    out.push_str(&format!(
        "final train loss {:.4}   val loss {}   loss floor (entropy rate) {}\n",
        s.final_loss,
        val,
        s.entropy_rate.map_or_else(|| "-".to_string(), |e| format!("{e:.4}"))
    ));
    out.push_str(&format!(
        "steps {} (skipped {})   mean step time {:.4} s   {:.0} tokens/s\n\n",
        s.steps, s.skipped_steps, s.mean_step_time_s, s.tokens_per_s
    ));
    out.push_str(
        "bytes sent per rank per step    measured (intra / inter)      analytic model (intra / inter)\n",
    );
    let mut ops: Vec<&String> = s.bytes_by_op.keys().chain(s.model_bytes_by_op.keys()).collect();
    ops.sort();
    ops.dedup();
    for op in ops {
        let m = s.bytes_by_op.get(op).copied().unwrap_or_default();
        let a = s.model_bytes_by_op.get(op).copied().unwrap_or_default();
        out.push_str(&format!(
            "  {:<28} {:>12} / {:<12}   {:>12} / {:<12}\n",
            op,
            fmt_bytes(m.intra),
            fmt_bytes(m.inter),
            fmt_bytes(a.intra),
            fmt_bytes(a.inter)
        ));
    }
    let (m, a) = (s.bytes_per_step, s.model_bytes_per_step);
    out.push_str(&format!(
        "  {:<28} {:>12} / {:<12}   {:>12} / {:<12}\n",
        "total",
        fmt_bytes(m.intra),
        fmt_bytes(m.inter),
        fmt_bytes(a.intra),
        fmt_bytes(a.inter)
    ));
    out
}

/// A progress bar over `steps` steps.
pub(crate) fn progress_bar(steps: usize, prefix: &str) -> ProgressBar {
    let pb = ProgressBar::new(steps as u64);
    let style = ProgressStyle::with_template("{prefix} [{bar:30}] {pos}/{len} {msg}")
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> ");
    pb.set_style(style);
    pb.set_prefix(prefix.to_string());
    pb
}

/// One line: this process's peak RSS against the memory model's prediction for
/// the `ranks` ranks it ran of `model` as `run` says (all of them with threads;
/// one, `rank`, under MPI).
pub(crate) fn print_memory<M: Model>(model: &M, run: &RunConfig, ranks: usize, rank: Option<usize>) {
    let predicted = zeropp_engine::launch::memory_prediction(model, run);
    let (Some(peak), Ok(p)) = (zeropp_engine::engine::memory::peak_rss(), predicted) else {
        return;
    };
    let predicted = (p.total() * ranks) as f64;
    let who = match rank {
        Some(r) => format!("rank {r}"),
        None => format!("this process ({ranks} ranks)"),
    };
    eprintln!(
        "memory: peak RSS of {who} {:.1} MB; memory model {:.1} MB ({:.1} MB states per rank); measured / model = {:.2}",
        peak as f64 / 1e6,
        predicted / 1e6,
        p.states as f64 / 1e6,
        peak as f64 / predicted
    );
}

/// Advances the progress bar after one optimizer step.
pub(crate) fn show_step(pb: &ProgressBar, r: &StepRecord) {
    pb.set_position(r.step as u64 + 1);
    pb.set_message(format!(
        "loss {:.4}{} | {:.0} tok/s | {:.3} MB inter-node/rank/step",
        r.loss,
        if r.skipped { " (skipped)" } else { "" },
        r.tokens_per_s,
        r.inter_node_bytes / 1e6
    ));
}
