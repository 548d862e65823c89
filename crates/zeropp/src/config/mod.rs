//! `zeropp train`'s and `zeropp compare`'s flags, and the one function that
//! turns them (with a DeepSpeed file, when given) into a
//! `zeropp_run::train::TrainConfig`: [`train_config`] (its first half,
//! [`build_config`], is what `compare` shares). Nothing here runs or prints.

use std::path::PathBuf;
use std::time::Duration;

use crate::models::{model_choice, model_help};
use clap::{Args, ValueEnum};
use zeropp_engine::config::{CommDtype, DeltaConfig, ZeroConfig, quant_spec};
use zeropp_engine::data::DataChoice;
use zeropp_engine::launch::Faults;
use zeropp_engine::{Backend, RunConfig};
use zeropp_run::train::TrainConfig;

use crate::CliError;

/// ZeRO mode preset.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Mode {
    /// Plain ZeRO-3 (16-bit gathers and reduce-scatter).
    Zero3,
    /// ZeRO++: qwZ INT8 + hpZ over the node + qgZ INT4.
    Zeropp,
    /// ZeRO++ with SDP4Bit's techniques: qwZ-delta (INT4 weight differences into
    /// the hpZ copy, so the forward gather stays in the node after the first
    /// step) and qgZ in two levels (INT8 inside the node, INT4 across) with
    /// Hadamard smoothing.
    ZeroppDelta,
}

/// Communication backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum BackendArg {
    /// MPI when an MPI launcher (mpirun, mpiexec, srun) started this process for a
    /// job of more than one process, else threads.
    Auto,
    /// One thread per rank in this process (even under an MPI launcher).
    Threads,
    /// One process per rank under an MPI launcher (`zeropp` built with `--features mpi`).
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
    /// Ranks (under MPI, the job's; when given, it must match).
    #[arg(long, default_value_t = 8)]
    pub world: usize,
    /// Ranks per simulated node (under MPI: the job's node size, else the ranks sharing memory).
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
    /// Learning rate [default: 3e-3, also when a DeepSpeed config sets none].
    #[arg(long)]
    pub lr: Option<f32>,
    /// DeepSpeed JSON config (batch, clipping, bf16, optimizer, zero_optimization).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Link model of the simulated cluster, e.g. `intra=100GB/s,inter=1GB/s,latency=5us`.
    #[arg(long)]
    pub link: Option<String>,
    /// Backend.
    #[arg(long, value_enum, default_value_t = BackendArg::Auto)]
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
    /// qwZ-delta on: the hpZ copy kept current by INT4 weight differences (on in zeropp-delta mode; needs hpZ).
    #[arg(long = "qwz-delta", overrides_with = "no_qwz_delta")]
    pub qwz_delta: bool,
    /// qwZ-delta off.
    #[arg(long = "no-qwz-delta")]
    pub no_qwz_delta: bool,
    /// qwZ-delta: rebuild the hpZ copy by a full gather every N steps (0 = only at the first step, after a skip or a checkpoint; default 100).
    #[arg(long = "qwz-delta-refresh", value_name = "N")]
    pub qwz_delta_refresh: Option<usize>,
    /// qwZ-delta's bits (4 or 8).
    #[arg(long = "qwz-delta-bits")]
    pub qwz_delta_bits: Option<u8>,
    /// qgZ in two levels: INT8 inside the node, the qgZ bits (INT4) across nodes (on in zeropp-delta mode).
    #[arg(long = "qgz-two-level", overrides_with = "no_qgz_two_level")]
    pub qgz_two_level: bool,
    /// qgZ with the same bits on both hops.
    #[arg(long = "no-qgz-two-level")]
    pub no_qgz_two_level: bool,
    /// qgZ rotates each group by a seeded Hadamard transform before quantizing it (on in zeropp-delta mode).
    #[arg(long = "qgz-hadamard", overrides_with = "no_qgz_hadamard")]
    pub qgz_hadamard: bool,
    /// qgZ without the Hadamard rotation.
    #[arg(long = "no-qgz-hadamard")]
    pub no_qgz_hadamard: bool,
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

/// What the flags (and the DeepSpeed file) of a run say: its configuration
/// (whose `model` names any built-in model, the candle Llama included) and
/// the file's warnings.
pub(crate) struct Planned {
    /// The run.
    pub(crate) cfg: TrainConfig,
    /// The DeepSpeed import's warnings.
    pub(crate) warnings: Vec<String>,
}

/// Builds the run configuration shared by `train` and `compare`, the first two
/// levels of the one precedence: the ZeRO switches start from `zero` (the
/// mode's preset), then the DeepSpeed file's keys; the run flags (`--batch`,
/// `--lr`, ...) then win over the file. `train_config` applies the technique
/// flags last.
pub(crate) fn build_config(run: &RunArgs, zero: ZeroConfig) -> Result<Planned, CliError> {
    let d = TrainConfig::default();
    let mut cfg = TrainConfig {
        model: model_choice(&run.model)?,
        data: match &run.data {
            Some(p) => DataChoice::File(p.clone()),
            None => d.data,
        },
        run: RunConfig {
            world: run.world,
            local_size: run.local_size,
            steps: run.steps,
            timeout: Duration::from_secs(run.timeout_s.max(1)),
            backend: match run.backend {
                BackendArg::Auto => Backend::Auto,
                BackendArg::Threads => Backend::Threads,
                BackendArg::Mpi => Backend::Mpi,
            },
            eval_batches: run.eval_batches,
            ..d.run
        },
    };
    cfg.run.engine.zero = zero;
    cfg.run.engine.seed = run.seed;
    let mut warnings = Vec::new();
    if let Some(path) = &run.config {
        let imp = zeropp_run::deepspeed::from_file(path, run.world, &cfg.run.engine)?;
        cfg.run.engine = imp.config;
        warnings = imp.warnings;
    }
    cfg.run.engine.zero.comm_dtype = match run.comm_dtype {
        DtypeArg::Bf16 if run.config.is_none() => CommDtype::Bf16,
        DtypeArg::F32 => CommDtype::F32,
        DtypeArg::Bf16 => cfg.run.engine.zero.comm_dtype,
    };
    if let Some(b) = run.batch {
        cfg.run.engine.global_batch = b;
    }
    if let Some(a) = run.grad_accum {
        cfg.run.engine.grad_accum = a;
    }
    if let Some(lr) = run.lr {
        cfg.run.engine.optim.lr = lr;
    }
    if let Some(l) = &run.link {
        cfg.run.link = Some(l.parse().map_err(|e| format!("--link: {e}"))?);
    }
    Ok(Planned { cfg, warnings })
}

/// `--mode`'s ZeRO switches: the defaults of the precedence.
fn mode_preset(a: &TrainArgs) -> ZeroConfig {
    match a.mode {
        Mode::Zero3 => ZeroConfig::zero3(),
        Mode::Zeropp => ZeroConfig::zeropp(a.run.local_size),
        Mode::ZeroppDelta => ZeroConfig::zeropp_delta(a.run.local_size),
    }
}

/// The ZeRO switches of the flags alone, over `--mode`'s preset (no DeepSpeed file).
#[cfg(test)]
pub(crate) fn zero_from_flags(a: &TrainArgs) -> Result<ZeroConfig, CliError> {
    apply_zero_flags(mode_preset(a), a)
}

/// `z` with every ZeRO flag of `a` that was given applied over it: the last
/// level of the precedence (a flag that is absent leaves `z`'s value).
fn apply_zero_flags(mut z: ZeroConfig, a: &TrainArgs) -> Result<ZeroConfig, CliError> {
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
                Some(r) => r
                    .parse::<zeropp_engine::config::CommDtype>()
                    .map_err(|e| format!("--loco-residuals: {e}"))?
                    .into(),
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
        if a.qgz_two_level {
            q.two_level = true;
        }
        if a.no_qgz_two_level {
            q.two_level = false;
        }
        if a.qgz_hadamard {
            q.hadamard = true;
        }
        if a.no_qgz_hadamard {
            q.hadamard = false;
        }
        Some(q)
    } else {
        if a.qgz_two_level || a.qgz_hadamard {
            return Err(
                "--qgz-two-level and --qgz-hadamard are options of qgZ, which is off (drop --no-qgz, \
                        or give --qgz)"
                    .into(),
            );
        }
        None
    };
    let delta_on = (z.qwz_delta.is_some() || a.qwz_delta) && !a.no_qwz_delta;
    z.qwz_delta = if delta_on {
        let d = z.qwz_delta.unwrap_or_default();
        let bits = a.qwz_delta_bits.unwrap_or(d.spec.bits().bits() as u8);
        Some(DeltaConfig {
            spec: quant_spec("qwZ-delta", bits, d.spec.group_size())?,
            refresh_every: a.qwz_delta_refresh.unwrap_or(d.refresh_every),
        })
    } else {
        if a.qwz_delta_refresh.is_some() || a.qwz_delta_bits.is_some() {
            return Err("--qwz-delta-refresh and --qwz-delta-bits need qwZ-delta (--qwz-delta, or --mode zeropp-delta)".into());
        }
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
    if a.stochastic_rounding {
        z.stochastic_rounding = true;
    }
    if a.no_prefetch {
        z.prefetch = false;
    }
    Ok(z)
}

/// The full training configuration of `zeropp train` (on any backend): the mode
/// preset, then the DeepSpeed file, then explicit technique flags, then the
/// metrics/checkpoint paths. Returns the DeepSpeed import warnings too.
pub(crate) fn train_config(args: &TrainArgs) -> Result<Planned, CliError> {
    // Defaults < DeepSpeed file < flags, each level applied once, in order.
    let mut p = build_config(&args.run, mode_preset(args))?;
    let cfg = &mut p.cfg;
    cfg.run.engine.zero = apply_zero_flags(cfg.run.engine.zero, args)?;
    apply_bucket_flags(args, &mut cfg.run.engine.zero.buckets)?;
    cfg.run.metrics = args.metrics.clone();
    cfg.run.save = args.save.clone();
    cfg.run.save_every = args.save_every;
    cfg.run.resume = args.resume.clone();
    Ok(p)
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

/// Environment variable read by [`faults_from_env`] (a test hook of the MPI and
/// cluster tests): `fail:RANK:STEP` makes that rank fail in the middle of that
/// step, `nan:RANK:STEP` makes its gradient NaN.
pub(crate) const FAULT_ENV: &str = "ZEROPP_FAULT";

/// Parses [`FAULT_ENV`] (unset or empty means no fault).
pub(crate) fn faults_from_env() -> Result<Faults, CliError> {
    match std::env::var(FAULT_ENV) {
        Ok(v) if !v.trim().is_empty() => parse_faults(&v),
        _ => Ok(Faults::default()),
    }
}

/// Parses a fault spec: `fail:RANK:STEP` or `nan:RANK:STEP`.
fn parse_faults(spec: &str) -> Result<Faults, CliError> {
    let bad = || format!("{FAULT_ENV}=`{spec}`: expected fail:RANK:STEP or nan:RANK:STEP");
    let parts: Vec<&str> = spec.trim().split(':').collect();
    let [kind, rank, step] = parts.as_slice() else { return Err(bad().into()) };
    let at = (rank.parse::<usize>().map_err(|_| bad())?, step.parse::<usize>().map_err(|_| bad())?);
    match *kind {
        "fail" => Ok(Faults { fail: Some(at), ..Faults::default() }),
        "nan" => Ok(Faults { nan_gradient: Some(at), ..Faults::default() }),
        _ => Err(bad().into()),
    }
}

/// True when `--NAME` appears on the command line (clap's defaults cannot tell).
pub(crate) fn flag_given(name: &str) -> bool {
    let eq = format!("{name}=");
    std::env::args_os().skip(1).any(|a| a.to_str().is_some_and(|a| a == name || a.starts_with(&eq)))
}

#[cfg(test)]
mod tests;
