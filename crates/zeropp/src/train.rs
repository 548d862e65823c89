//! `zeropp train`: flags -> `zeropp_engine::train::TrainConfig`, a progress bar,
//! and the final summary. All logic lives in `zeropp_engine::train`.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use zeropp_engine::config::{CommDtype, QgzConfig, ZeroConfig, quant_spec};
use zeropp_engine::metrics::StepRecord;
use zeropp_engine::model::{GptConfig, MlpConfig};
use zeropp_engine::train::{
    Backend, DataChoice, ModelChoice, TrainConfig, train_model_described, train_with,
};

use crate::CliError;
use crate::summary::{print_data, print_plan, print_report, print_warnings};

/// ZeRO mode preset.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Mode {
    /// Plain ZeRO-3 (16-bit gathers and reduce-scatter).
    Zero3,
    /// ZeRO++: qwZ INT8 + hpZ over the node + qgZ INT4.
    Zeropp,
}

/// Communication backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum BackendArg {
    /// One thread per rank in this process.
    Threads,
    /// One process per rank under `mpirun` (`zeropp train` built with `--features mpi`).
    Mpi,
}

/// Baseline communication dtype.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum DtypeArg {
    /// bfloat16 (ZeRO-3's 16-bit communication).
    Bf16,
    /// f32 (exact).
    F32,
}

/// The workload and cluster flags shared by `train` and `compare`.
#[derive(Debug, Clone, Args)]
pub(crate) struct RunArgs {
    /// Ranks.
    #[arg(long, default_value_t = 8)]
    pub world: usize,
    /// Ranks per simulated node.
    #[arg(long = "local-size", default_value_t = 4)]
    pub local_size: usize,
    /// Baseline communication dtype.
    #[arg(long = "comm-dtype", value_enum, default_value_t = DtypeArg::Bf16)]
    pub comm_dtype: DtypeArg,
    /// Model: a preset (gpt-tiny, gpt, gpt-1m, gpt-medium, gpt-10m, gpt-40m, gpt2-small, mlp, mlp-tiny) or a GPT shape like gpt:d=768,layers=12,heads=12,seq=256.
    #[arg(long, default_value = "gpt", long_help = model_help())]
    pub model: String,
    /// Training text file (default: the project's generated Markov text).
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Optimizer steps.
    #[arg(long, default_value_t = 800)]
    pub steps: usize,
    /// Seed of the initialisation and of the batches.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Global batch (sequences per optimizer step, split evenly over the ranks).
    #[arg(long)]
    pub batch: Option<usize>,
    /// Micro-batches accumulated per optimizer step.
    #[arg(long = "grad-accum")]
    pub grad_accum: Option<usize>,
    /// Learning rate.
    #[arg(long)]
    pub lr: Option<f32>,
    /// DeepSpeed JSON config (batch, clipping, bf16, optimizer, zero_optimization).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Link model of the simulated cluster, e.g. `intra=100GB/s,inter=1GB/s,latency=5us`.
    #[arg(long)]
    pub link: Option<String>,
    /// Backend.
    #[arg(long, value_enum, default_value_t = BackendArg::Threads)]
    pub backend: BackendArg,
    /// Seconds a rank waits for a silent peer before failing.
    #[arg(long = "timeout", default_value_t = 60)]
    pub timeout_s: u64,
    /// Validation batches evaluated at the end (0 = none).
    #[arg(long = "eval-batches", default_value_t = 4)]
    pub eval_batches: usize,
}

/// Flags of `zeropp train`.
#[derive(Debug, Clone, Args)]
pub(crate) struct TrainArgs {
    #[command(flatten)]
    pub run: RunArgs,
    /// ZeRO mode preset (techniques can be switched one by one below).
    #[arg(long, value_enum, default_value_t = Mode::Zeropp)]
    pub mode: Mode,
    /// Quantized weight gather (qwZ) on.
    #[arg(long, overrides_with = "no_qwz")]
    pub qwz: bool,
    /// qwZ off.
    #[arg(long = "no-qwz")]
    pub no_qwz: bool,
    /// hpZ group size (1 = off; default: the node size in zeropp mode).
    #[arg(long)]
    pub hpz: Option<usize>,
    /// Quantized gradient reduce-scatter (qgZ) on.
    #[arg(long, overrides_with = "no_qgz")]
    pub qgz: bool,
    /// qgZ off.
    #[arg(long = "no-qgz")]
    pub no_qgz: bool,
    /// qwZ bits (8 or 4).
    #[arg(long)]
    pub qwz_bits: Option<u8>,
    /// qgZ bits (4 or 8).
    #[arg(long = "qgz-bits")]
    pub qgz_bits: Option<u8>,
    /// qgZ error feedback on both hops, LoCo style (err_beta 0.8, reset every 1024 steps, bf16
    /// residuals). Off by default: it trained worse than no feedback on held-out text
    /// (docs/PERFORMANCE.md, "Fidelity").
    #[arg(long = "error-feedback")]
    pub error_feedback: bool,
    /// LoCo moving-average factor err_beta in [0, 1) (implies --error-feedback).
    #[arg(long = "loco-beta")]
    pub loco_beta: Option<f32>,
    /// Reset the LoCo residuals every N optimizer steps (0 = never; implies --error-feedback).
    #[arg(long = "loco-reset")]
    pub loco_reset: Option<usize>,
    /// How the LoCo residuals are stored: bf16 (default, half the memory) or f32 (implies --error-feedback).
    #[arg(long = "loco-residuals", value_name = "bf16|f32")]
    pub loco_residuals: Option<String>,
    /// qgZ rounds stochastically (unbiased; the default in zeropp mode).
    #[arg(long = "qgz-stochastic", overrides_with = "qgz_nearest")]
    pub qgz_stochastic: bool,
    /// qgZ rounds to nearest (the ZeRO++ paper's and DeepSpeed's rounding).
    #[arg(long = "qgz-nearest")]
    pub qgz_nearest: bool,
    /// Routing of the world collectives: hierarchical (rail then node, as NCCL/HSDP; default) or flat.
    #[arg(long, value_name = "hierarchical|flat")]
    pub baseline: Option<String>,
    /// How hpZ holds and gathers its secondary shard: dense (the baseline dtype) or int8 (qwZ's encodings).
    #[arg(long = "hpz-wire", value_name = "dense|int8")]
    pub hpz_wire: Option<String>,
    /// qwZ quantization group size (elements per scale).
    #[arg(long = "qwz-group-size")]
    pub qwz_group_size: Option<usize>,
    /// qgZ quantization group size (elements per scale).
    #[arg(long = "qgz-group-size")]
    pub qgz_group_size: Option<usize>,
    /// Reduce 1-D parameters (biases, norms) at full precision under qgZ, as DeepSpeed does
    /// (on by default in zeropp mode).
    #[arg(long = "qgz-exclude-1d", overrides_with = "no_qgz_exclude_1d")]
    pub qgz_exclude_1d: bool,
    /// Send the 1-D parameters through INT4 qgZ like the matrices.
    #[arg(long = "no-qgz-exclude-1d")]
    pub no_qgz_exclude_1d: bool,
    /// No qgZ error feedback (the default; kept for scripts that say so).
    #[arg(long = "no-error-feedback", conflicts_with_all = ["error_feedback", "loco_beta", "loco_reset", "loco_residuals"])]
    pub no_error_feedback: bool,
    /// Let quantization groups straddle two tensors (the pre-0.2 layout; for comparisons).
    #[arg(long = "packed-groups")]
    pub packed_groups: bool,
    /// Stochastic rounding in every quantizer (qwZ's too; qgZ's alone is --qgz-stochastic).
    #[arg(long = "stochastic-rounding")]
    pub stochastic_rounding: bool,
    /// Disable the prefetch of the next layer's gather.
    #[arg(long = "no-prefetch")]
    pub no_prefetch: bool,
    /// DeepSpeed's reduce_bucket_size: most padded elements per gradient reduce call.
    #[arg(long = "reduce-bucket-size", value_name = "ELEMENTS")]
    pub reduce_bucket_size: Option<usize>,
    /// DeepSpeed's stage3_prefetch_bucket_size: largest layer (padded elements) prefetched; 0 = none.
    #[arg(long = "prefetch-bucket-size", value_name = "ELEMENTS")]
    pub prefetch_bucket_size: Option<usize>,
    /// DeepSpeed's stage3_param_persistence_threshold: parameters of at most this many elements are kept whole on every rank.
    #[arg(long = "param-persistence-threshold", value_name = "ELEMENTS")]
    pub param_persistence_threshold: Option<usize>,
    /// DeepSpeed's stage3_max_live_parameters: most gathered elements alive when prefetching.
    #[arg(long = "max-live-parameters", value_name = "ELEMENTS")]
    pub max_live_parameters: Option<usize>,
    /// Write JSON Lines metrics (one object per step, then a summary).
    #[arg(long)]
    pub metrics: Option<PathBuf>,
    /// Save sharded checkpoints into this directory.
    #[arg(long)]
    pub save: Option<PathBuf>,
    /// Save every N steps (and at the end).
    #[arg(long = "save-every", default_value_t = 0)]
    pub save_every: usize,
    /// Resume from a checkpoint directory.
    #[arg(long)]
    pub resume: Option<PathBuf>,
}

/// The model of a `--model` value: a preset name (`gpt-tiny`, `gpt`, `gpt-1m`,
/// ... `gpt2-small`, `mlp`, `mlp-tiny`), optionally followed by `:key=value,...`
/// overrides of a GPT's shape (`d`, `layers`, `heads`, `seq`, `mlp`), e.g.
/// `gpt:d=768,layers=12,heads=12,seq=256`. The shape is validated by the engine.
pub(crate) fn model_choice(spec: &str) -> Result<ModelChoice, CliError> {
    let (name, keys) = match spec.split_once(':') {
        Some((n, k)) => (n.trim(), Some(k)),
        None => (spec.trim(), None),
    };
    let lower = name.to_ascii_lowercase();
    let base = match lower.as_str() {
        "gpt-small" => ModelChoice::Gpt(GptConfig::default_small()),
        "mlp" | "mlp-small" => ModelChoice::Mlp(MlpConfig::default_small()),
        "mlp-tiny" => ModelChoice::Mlp(MlpConfig::tiny()),
        other => match GptConfig::preset(other) {
            Some(g) => ModelChoice::Gpt(g),
            None => {
                let names: Vec<&str> = GptConfig::presets().iter().map(|(n, _)| *n).collect();
                return Err(format!(
                    "--model: unknown model `{other}` (expected {}, mlp or mlp-tiny)",
                    names.join(", ")
                )
                .into());
            }
        },
    };
    let Some(keys) = keys else { return Ok(base) };
    let ModelChoice::Gpt(mut g) = base else {
        return Err(format!(
            "--model: `{name}` takes no shape; only GPT models do (e.g. gpt:d=256,layers=4)"
        )
        .into());
    };
    for kv in keys.split(',').map(str::trim).filter(|kv| !kv.is_empty()) {
        let Some((k, v)) = kv.split_once('=') else {
            return Err(format!("--model: `{kv}` in `{spec}` is not key=value").into());
        };
        let (k, v) = (k.trim(), v.trim());
        let field = match k.to_ascii_lowercase().as_str() {
            "d" | "d_model" => &mut g.d_model,
            "layers" | "n_layer" => &mut g.n_layer,
            "heads" | "n_head" => &mut g.n_head,
            "seq" | "seq_len" => &mut g.seq_len,
            "mlp" | "mlp_ratio" => &mut g.mlp_ratio,
            _ => {
                return Err(format!(
                    "--model: unknown key `{k}` in `{spec}` (expected d, layers, heads, seq or mlp)"
                )
                .into());
            }
        };
        *field = v
            .parse::<usize>()
            .ok()
            .filter(|&x| x > 0)
            .ok_or_else(|| format!("--model: `{k}={v}` is not a positive integer"))?;
    }
    g.validate().map_err(|e| format!("--model `{spec}`: {e}"))?;
    Ok(ModelChoice::Gpt(g))
}

/// The `--model` help: the presets with their parameter counts (at a byte-level
/// vocabulary of 256; training takes the data's vocabulary).
pub(crate) fn model_help() -> String {
    let mut s = String::from(
        "Model: a preset, optionally with GPT shape overrides `NAME:d=768,layers=12,heads=12,seq=256[,mlp=4]`.\n\
         Presets (parameters at a byte vocabulary of 256; training uses the data's vocabulary):\n",
    );
    for (name, g) in GptConfig::presets() {
        s += &format!(
            "  {name:<11} d {:>3}, {:>2} layers, {:>2} heads, seq {:>4}: {:>6.2}M\n",
            g.d_model,
            g.n_layer,
            g.n_head,
            g.seq_len,
            g.with_vocab(256).num_params() as f64 / 1e6
        );
    }
    s += &crate::llama::help();
    s += "  mlp, mlp-tiny  context-window MLP language models\n\
          gpt2-small is GPT-2 small's shape; GPT-2's 124M counts a tied 50257-token embedding (38.6M).";
    s
}

/// Builds the run configuration shared by `train` and `compare` (ZeRO switches
/// start from `zero`, then the DeepSpeed config, then the explicit flags).
pub(crate) fn build_config(run: &RunArgs, zero: ZeroConfig) -> Result<(TrainConfig, Vec<String>), CliError> {
    let mut cfg = TrainConfig {
        // The Llama is built from the data by `run` (its vocabulary is the data's);
        // the native choice here is then unused.
        model: match crate::llama::parse(&run.model)? {
            Some(_) => TrainConfig::default().model,
            None => model_choice(&run.model)?,
        },
        data: match &run.data {
            Some(p) => DataChoice::File(p.clone()),
            None => TrainConfig::default().data,
        },
        world: run.world,
        local_size: run.local_size,
        steps: run.steps,
        timeout: Duration::from_secs(run.timeout_s.max(1)),
        backend: match run.backend {
            BackendArg::Threads => Backend::Threads,
            BackendArg::Mpi => Backend::Mpi,
        },
        eval_batches: run.eval_batches,
        ..TrainConfig::default()
    };
    cfg.engine.zero = zero;
    cfg.engine.seed = run.seed;
    let mut warnings = Vec::new();
    if let Some(path) = &run.config {
        let imp = zeropp_engine::deepspeed::from_file(path, run.world, &cfg.engine)?;
        cfg.engine = imp.config;
        warnings = imp.warnings;
    }
    cfg.engine.zero.comm_dtype = match run.comm_dtype {
        DtypeArg::Bf16 if run.config.is_none() => CommDtype::Bf16,
        DtypeArg::F32 => CommDtype::F32,
        DtypeArg::Bf16 => cfg.engine.zero.comm_dtype,
    };
    if let Some(b) = run.batch {
        cfg.engine.global_batch = b;
    }
    if let Some(a) = run.grad_accum {
        cfg.engine.grad_accum = a;
    }
    if let Some(lr) = run.lr {
        cfg.engine.optim.lr = lr;
    }
    if let Some(l) = &run.link {
        cfg.link = Some(l.parse().map_err(|e| format!("--link: {e}"))?);
    }
    Ok((cfg, warnings))
}

pub(crate) fn zero_from_flags(a: &TrainArgs) -> Result<ZeroConfig, CliError> {
    let mut z = match a.mode {
        Mode::Zero3 => ZeroConfig::zero3(),
        Mode::Zeropp => ZeroConfig::zeropp(a.run.local_size),
    };
    // The technique switches, then the specs and options of those that are on:
    // bits and group sizes are checked (and errors reported) only for those.
    let qwz_on = (z.qwz.is_some() || a.qwz) && !a.no_qwz;
    let qgz_on = (z.qgz.is_some() || a.qgz) && !a.no_qgz;
    if let Some(h) = a.hpz {
        z.hpz_size = h;
    }
    z.qwz = if qwz_on {
        let d = z.qwz.unwrap_or_else(ZeroConfig::default_qwz_spec);
        let bits = a.qwz_bits.unwrap_or(d.bits().bits() as u8);
        Some(quant_spec("qwZ", bits, a.qwz_group_size.unwrap_or(d.group_size()))?)
    } else {
        None
    };
    z.qgz = if qgz_on {
        let mut q = z.qgz.unwrap_or_default();
        let bits = a.qgz_bits.unwrap_or(q.spec.bits().bits() as u8);
        q.spec = quant_spec("qgZ", bits, a.qgz_group_size.unwrap_or(q.spec.group_size()))?;
        if a.error_feedback || a.loco_beta.is_some() || a.loco_reset.is_some() || a.loco_residuals.is_some() {
            let d = q.error_feedback.unwrap_or_default();
            let residual_dtype = match &a.loco_residuals {
                Some(r) => r.parse().map_err(|e| format!("--loco-residuals: {e}"))?,
                None => d.residual_dtype,
            };
            q.error_feedback = Some(zeropp_engine::config::LocoConfig {
                err_beta: a.loco_beta.unwrap_or(d.err_beta),
                reset_t: a.loco_reset.unwrap_or(d.reset_t),
                residual_dtype,
            });
        }
        if a.qgz_stochastic {
            q.stochastic = true;
        }
        if a.qgz_nearest {
            q.stochastic = false;
        }
        if a.qgz_exclude_1d {
            q.exclude_1d = true;
        }
        if a.no_qgz_exclude_1d {
            q.exclude_1d = false;
        }
        if a.no_error_feedback {
            q.error_feedback = None;
        }
        Some(q)
    } else {
        None
    };
    if a.packed_groups {
        z.per_tensor_groups = false;
    }
    if let Some(b) = &a.baseline {
        z.routing = b.parse().map_err(|e| format!("--baseline: {e}"))?;
    }
    if let Some(w) = &a.hpz_wire {
        z.hpz_wire = w.parse().map_err(|e| format!("--hpz-wire: {e}"))?;
    }
    z.stochastic_rounding = a.stochastic_rounding;
    z.prefetch = !a.no_prefetch;
    Ok(z)
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

/// Runs `zeropp train`.
pub(crate) fn run(args: &TrainArgs) -> Result<(), CliError> {
    if args.run.backend == BackendArg::Mpi {
        return crate::train_mpi::run(args);
    }
    let (cfg, warnings) = train_config(args)?;
    print_warnings(&warnings);
    cfg.engine.validate(cfg.world, cfg.local_size)?;
    print_data(&cfg.data)?;
    print_plan(&args.run.model, &cfg, cfg.world / cfg.local_size.max(1), None);
    let llama = match crate::llama::parse(&args.run.model)? {
        Some(shape) => {
            let (data, info) = zeropp_engine::train::load_data(&cfg.data)?;
            Some((shape.build(data.vocab_size())?, data, info))
        }
        None => None,
    };
    let pb = progress_bar(cfg.steps, "train");
    let report = match &llama {
        Some((model, data, info)) => {
            train_model_described(model, data, info, &cfg, &mut |r| show_step(&pb, r))
        }
        None => train_with(&cfg, &mut |r| show_step(&pb, r)),
    };
    pb.finish();
    let report = report?;
    print_report(&report.summary, cfg.metrics.as_deref());
    print_memory(&cfg, llama.as_ref().map(|(m, _, _)| m), cfg.world, None);
    Ok(())
}

/// One line: this process's peak RSS against the memory model's prediction for
/// the `ranks` ranks it ran (all of them with threads; one, `rank`, under MPI),
/// for the native model of `cfg` or the candle model `candle`.
pub(crate) fn print_memory(
    cfg: &TrainConfig,
    candle: Option<&zeropp_candle::CandleModel>,
    ranks: usize,
    rank: Option<usize>,
) {
    let predicted = match candle {
        Some(m) => zeropp_engine::train::memory_prediction_for(m, cfg),
        None => zeropp_engine::train::memory_prediction(cfg),
    };
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

/// The full training configuration of `zeropp train` (on any backend): the mode
/// preset, then the DeepSpeed file, then explicit technique flags, then the
/// metrics/checkpoint paths. Returns the DeepSpeed import warnings too.
pub(crate) fn train_config(args: &TrainArgs) -> Result<(TrainConfig, Vec<String>), CliError> {
    let (mut cfg, warnings) = build_config(&args.run, zero_from_flags(args)?)?;
    // Explicit technique flags win over the DeepSpeed file.
    if args.run.config.is_some() {
        let z = zero_from_flags(args)?;
        if args.qwz || args.no_qwz {
            cfg.engine.zero.qwz = z.qwz;
        }
        if args.qgz || args.no_qgz {
            // The switch only: a qgZ the file turned on keeps its LoCo parameters.
            cfg.engine.zero.qgz = match (z.qgz, cfg.engine.zero.qgz) {
                (Some(flags), Some(file)) => Some(QgzConfig { spec: flags.spec, ..file }),
                (flags, _) => flags,
            };
        }
        if let Some(h) = args.hpz {
            cfg.engine.zero.hpz_size = h;
        }
    }
    apply_bucket_flags(args, &mut cfg.engine.zero.buckets)?;
    cfg.metrics = args.metrics.clone();
    cfg.save = args.save.clone();
    cfg.save_every = args.save_every;
    cfg.resume = args.resume.clone();
    Ok((cfg, warnings))
}

/// The bucket knob flags, over the DeepSpeed file's values.
fn apply_bucket_flags(a: &TrainArgs, k: &mut zeropp_engine::config::BucketKnobs) -> Result<(), CliError> {
    if let Some(r) = a.reduce_bucket_size {
        if r == 0 {
            return Err("--reduce-bucket-size: must be > 0 (omit it for one reduce per layer)".into());
        }
        k.reduce_bucket_size = Some(r);
    }
    if a.prefetch_bucket_size.is_some() {
        k.prefetch_bucket_size = a.prefetch_bucket_size;
    }
    if let Some(t) = a.param_persistence_threshold {
        k.param_persistence_threshold = t;
    }
    if a.max_live_parameters.is_some() {
        k.max_live_parameters = a.max_live_parameters;
    }
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_names_map_to_their_default_shapes() {
        assert!(matches!(model_choice("gpt"), Ok(ModelChoice::Gpt(g)) if g == GptConfig::default_small()));
        assert!(matches!(model_choice("GPT-Tiny"), Ok(ModelChoice::Gpt(g)) if g == GptConfig::tiny()));
        assert!(
            matches!(model_choice("mlp-small"), Ok(ModelChoice::Mlp(m)) if m == MlpConfig::default_small())
        );
        assert!(matches!(model_choice("mlp-tiny"), Ok(ModelChoice::Mlp(m)) if m == MlpConfig::tiny()));
        let err = model_choice("rnn").err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains("unknown model `rnn`"), "{err}");
    }

    #[test]
    fn bucket_flags_map_onto_the_knobs() -> Result<(), CliError> {
        #[derive(clap::Parser)]
        struct Cmd {
            #[command(flatten)]
            train: TrainArgs,
        }
        use clap::Parser as _;
        let parse = |args: &[&str]| -> Result<TrainConfig, CliError> {
            let cmd = Cmd::try_parse_from(std::iter::once("train").chain(args.iter().copied()))?;
            Ok(train_config(&cmd.train)?.0)
        };
        let k = parse(&[
            "--reduce-bucket-size",
            "4096",
            "--prefetch-bucket-size",
            "0",
            "--param-persistence-threshold",
            "100",
            "--max-live-parameters",
            "1000000",
        ])?
        .engine
        .zero
        .buckets;
        assert_eq!(
            (
                k.reduce_bucket_size,
                k.prefetch_bucket_size,
                k.param_persistence_threshold,
                k.max_live_parameters
            ),
            (Some(4096), Some(0), 100, Some(1_000_000))
        );
        assert_eq!(parse(&[])?.engine.zero.buckets, Default::default());
        for (args, says) in [
            (&["--reduce-bucket-size", "0"][..], "--reduce-bucket-size"),
            (&["--max-live-parameters", "x"][..], "--max-live-parameters"),
        ] {
            let err = parse(args).err().map(|e| e.to_string()).unwrap_or_default();
            assert!(err.contains(says), "{args:?}: {err}");
        }
        Ok(())
    }

    #[test]
    fn gpt_shapes_parse_and_bad_keys_name_themselves() {
        let g = match model_choice("gpt:d=768,layers=12,heads=12,seq=256") {
            Ok(ModelChoice::Gpt(g)) => g,
            other => panic!("{other:?}"),
        };
        assert_eq!((g.d_model, g.n_layer, g.n_head, g.seq_len, g.mlp_ratio), (768, 12, 12, 256, 4));
        // A preset with an override keeps the rest of its shape.
        assert!(matches!(model_choice("gpt2-small:seq=256"),
            Ok(ModelChoice::Gpt(g)) if g == GptConfig { seq_len: 256, ..GptConfig::shape(768, 12, 12, 1024) }));
        for (spec, says) in [
            ("gpt:d=768,depth=3", "unknown key `depth`"),
            ("gpt:layers=x", "`layers=x` is not a positive integer"),
            ("gpt:heads=0", "`heads=0` is not a positive integer"),
            ("gpt:d=100,heads=3", "n_head 3 does not divide d_model 100"),
            ("gpt:seq=4096", "seq_len 4096 exceeds"),
            ("gpt:d", "`d` in `gpt:d` is not key=value"),
            ("mlp:d=3", "takes no shape"),
            ("gpt-7b", "unknown model `gpt-7b`"),
        ] {
            let err = model_choice(spec).err().map(|e| e.to_string()).unwrap_or_default();
            assert!(err.contains(says), "{spec}: {err}");
        }
        // The help lists every preset with its parameter count.
        let help = model_help();
        for (name, g) in GptConfig::presets() {
            let line =
                help.lines().find(|l| l.trim_start().starts_with(&format!("{name} "))).unwrap_or_default();
            assert!(line.contains(&format!("{:.2}M", g.with_vocab(256).num_params() as f64 / 1e6)), "{line}");
        }
    }

    /// `zeropp train`'s flags as the CLI parses them.
    fn zero(args: &[&str]) -> Result<ZeroConfig, CliError> {
        #[derive(clap::Parser)]
        struct Cmd {
            #[command(flatten)]
            train: TrainArgs,
        }
        use clap::Parser as _;
        let cmd = Cmd::try_parse_from(std::iter::once("train").chain(args.iter().copied()))?;
        zero_from_flags(&cmd.train)
    }

    #[test]
    fn zeropp_flags_map_onto_the_config() -> Result<(), CliError> {
        let local = 4;
        // The default mode is ZeRO++ with its default options, routed hierarchically.
        let d = zero(&[])?;
        assert_eq!(d, ZeroConfig::zeropp(local));
        // No error feedback, the 1-D exclusion, stochastic rounding in qgZ only.
        assert!(d.error_feedback().is_none() && d.exclude_1d() && d.qgz_stochastic());
        assert!(!d.stochastic_rounding);
        assert_eq!(d.routing, zeropp_engine::config::Routing::Hierarchical);
        // `--no-error-feedback` is the default, kept for scripts.
        assert_eq!(zero(&["--no-error-feedback"])?, d);
        // The paper's plain variant.
        assert_eq!(zero(&["--qgz-nearest", "--no-qgz-exclude-1d"])?, ZeroConfig::zeropp_plain(local));
        // DeepSpeed's LoCo-ZeRO++, as the default was before.
        let loco_qgz = zero(&["--error-feedback", "--qgz-nearest"])?;
        assert_eq!(loco_qgz.qgz, Some(QgzConfig::loco(ZeroConfig::default_qgz_spec())));
        assert_eq!(zero(&["--qgz-nearest", "--qgz-stochastic"])?, d);
        // Routing, the hpZ wire, LoCo's parameters.
        assert_eq!(zero(&["--baseline", "flat"])?.routing, zeropp_engine::config::Routing::Flat);
        assert_eq!(zero(&["--hpz-wire", "int8"])?.hpz_wire, zeropp_engine::config::HpzWire::Int8);
        let loco = zero(&["--loco-beta", "0.5", "--loco-reset", "10"])?.error_feedback();
        assert_eq!(loco.map(|l| (l.err_beta, l.reset_t, l.residual_dtype)), Some((0.5, 10, CommDtype::Bf16)));
        let f32_res = zero(&["--loco-residuals", "f32"])?.error_feedback();
        assert_eq!(f32_res.map(|l| l.residual_dtype), Some(CommDtype::F32));
        // ZeRO-3 has no qgZ, so no qgZ options.
        let z3 = zero(&["--mode", "zero3"])?;
        assert!(z3.qgz.is_none() && z3.qwz.is_none());
        // Bad values are one-line errors naming the flag.
        for (args, says) in [
            (&["--baseline", "ring"][..], "--baseline"),
            (&["--hpz-wire", "int3"][..], "--hpz-wire"),
            (&["--no-error-feedback", "--loco-beta", "0.5"][..], "cannot be used with"),
            (&["--loco-residuals", "f16"][..], "--loco-residuals"),
        ] {
            let err = zero(args).err().map(|e| e.to_string()).unwrap_or_default();
            assert!(err.contains(says), "{args:?}: {err}");
        }
        Ok(())
    }
}
