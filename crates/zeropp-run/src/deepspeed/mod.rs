//! A reader for DeepSpeed JSON configurations, so DeepSpeed users can bring theirs.
//!
//! The supported keys are mapped onto [`EngineConfig`]:
//!
//! | DeepSpeed key | engine field |
//! |---|---|
//! | `train_batch_size` | `global_batch` |
//! | `train_micro_batch_size_per_gpu` | (checked: `global_batch / (world * grad_accum)`) |
//! | `gradient_accumulation_steps` | `grad_accum` |
//! | `gradient_clipping` | `gradient_clipping` |
//! | `bf16.enabled` | `zero.comm_dtype` (`true` = bf16, `false` = f32) |
//! | `optimizer.type` (`AdamW`/`Adam`), `optimizer.params.{lr,betas,eps,weight_decay}` | `optim` |
//! | `zero_optimization.stage` | `zero.stage` (only 3) |
//! | `zero_optimization.zero_quantized_weights` | `zero.qwz` (on: the base's spec, or INT8 in groups of 256) |
//! | `zero_optimization.zero_hpz_partition_size` | `zero.hpz_size` |
//! | `zero_optimization.zero_quantized_gradients` | `zero.qgz` (on: the base's qgZ, or INT4 in groups of 256 without options) |
//! | `zero_optimization.zeropp_loco_param.{err_beta,reset_T}` | `zero.qgz.error_feedback` (LoCo; ignored, with a warning, when qgZ is off) |
//! | `zero_optimization.{reduce_bucket_size, stage3_prefetch_bucket_size, stage3_param_persistence_threshold, stage3_max_live_parameters}` | `zero.buckets` ([`BucketKnobs`](zeropp_engine::config::BucketKnobs); integers or integral numbers such as `5e8`) |
//!
//! Keys DeepSpeed knows but this engine does not model (the all-gather bucket size, overlap
//! switches, logging) are reported as warnings; unknown keys are warnings too.
//! Wrong types, unsupported values (stage 1, `fp16.enabled`, another optimizer)
//! and inconsistent batch arithmetic are errors.

use serde_json::Value;

use crate::RunError;
use zeropp_engine::config::{CommDtype, EngineConfig, ZeroConfig};

mod json;
mod sections;

use json::{FINITE, POSITIVE, Section, type_err};

/// The result of reading a DeepSpeed config: the engine configuration and the
/// keys that were not applied.
#[derive(Debug, Clone, PartialEq)]
pub struct DeepSpeedImport {
    /// The configuration with the DeepSpeed values applied.
    pub config: EngineConfig,
    /// One line per ignored or unknown key.
    pub warnings: Vec<String>,
}

/// Top-level keys DeepSpeed defines that have no effect here (reported as warnings).
const IGNORED_TOP: &[&str] = &[
    "steps_per_print",
    "wall_clock_breakdown",
    "dump_state",
    "prescale_gradients",
    "gradient_predivide_factor",
    "sparse_gradients",
    "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer",
    "communication_data_type",
    "flops_profiler",
    "tensorboard",
    "wandb",
    "csv_monitor",
    "comms_logger",
    "activation_checkpointing",
    "memory_breakdown",
    "seq_parallel_communication_data_type",
];

/// Resolves DeepSpeed's batch triple for `world` ranks into `(global_batch, grad_accum)`.
///
/// Any of the three may be missing; the given ones must satisfy
/// `train_batch_size = micro * grad_accum * world`.
pub fn resolve_batch(
    train_batch_size: Option<usize>,
    micro: Option<usize>,
    grad_accum: Option<usize>,
    world: usize,
) -> Result<Option<(usize, usize)>, RunError> {
    let w = world.max(1);
    let bad = |msg: String| Err(RunError::InvalidConfig(format!("DeepSpeed config: {msg}")));
    match (train_batch_size, micro, grad_accum) {
        (None, None, None) => Ok(None),
        (Some(t), Some(m), Some(g)) => {
            if t != m * g * w {
                return bad(format!(
                    "train_batch_size {t} != train_micro_batch_size_per_gpu {m} x gradient_accumulation_steps {g} x world {w}"
                ));
            }
            Ok(Some((t, g)))
        }
        (Some(t), Some(m), None) => {
            if t % (m * w) != 0 {
                return bad(format!(
                    "train_batch_size {t} is not divisible by train_micro_batch_size_per_gpu {m} x world {w}"
                ));
            }
            Ok(Some((t, t / (m * w))))
        }
        (Some(t), None, g) => {
            let g = g.unwrap_or(1);
            if t % (g * w) != 0 {
                return bad(format!(
                    "train_batch_size {t} is not divisible by gradient_accumulation_steps {g} x world {w}"
                ));
            }
            Ok(Some((t, g)))
        }
        (None, Some(m), g) => {
            let g = g.unwrap_or(1);
            Ok(Some((m * g * w, g)))
        }
        (None, None, Some(_)) => {
            bad("gradient_accumulation_steps alone does not fix the batch: also give train_batch_size or train_micro_batch_size_per_gpu".into())
        }
    }
}

/// Parses DeepSpeed JSON text and applies it on top of `base` for `world` ranks.
///
/// ```
/// use zeropp_engine::config::EngineConfig;
/// use zeropp_run::deepspeed::from_json_str;
/// let json = r#"{
///   "train_batch_size": 32, "gradient_accumulation_steps": 2,
///   "bf16": {"enabled": true},
///   "zero_optimization": {"stage": 3, "zero_quantized_weights": true,
///     "zero_hpz_partition_size": 4, "zero_quantized_gradients": true,
///     "overlap_comm": true}
/// }"#;
/// let imp = from_json_str(json, 8, &EngineConfig::default())?;
/// assert_eq!(imp.config.global_batch, 32);
/// assert_eq!(imp.config.micro_batch(8)?, 2);
/// assert!(imp.config.zero.qwz.is_some() && imp.config.zero.qgz.is_some());
/// assert_eq!(imp.warnings.len(), 1); // overlap_comm is not modelled
/// # Ok::<(), zeropp_run::RunError>(())
/// ```
pub fn from_json_str(text: &str, world: usize, base: &EngineConfig) -> Result<DeepSpeedImport, RunError> {
    let root: Value = serde_json::from_str(text)
        .map_err(|source| RunError::Json { what: "DeepSpeed config is not valid JSON", source })?;
    let obj = Section::root(&root)?;
    let mut warnings = Vec::new();
    let mut cfg = base.clone();
    // The ZeRO++ switches and LoCo are applied after the loop, whatever the key order.
    let (mut qwz_on, mut qgz_on, mut loco_param) = (None, None, None);

    for (key, value) in obj.entries() {
        match key.as_str() {
            "train_batch_size" | "train_micro_batch_size_per_gpu" | "gradient_accumulation_steps" => {}
            "gradient_clipping" => {
                if let Some(c) = obj.get(key, FINITE, &mut warnings)? {
                    if c < 0.0 {
                        return Err(type_err(key, "a number >= 0", value));
                    }
                    cfg.gradient_clipping = if c > 0.0 { Some(c) } else { None };
                }
            }
            "bf16" => {
                let b = Section::at("bf16", value)?;
                for (k, _) in b.entries() {
                    if k != "enabled" {
                        warnings.push(format!("`bf16.{k}` is not supported and was ignored"));
                    }
                }
                match b.bool("enabled")? {
                    Some(true) => cfg.zero.comm_dtype = CommDtype::Bf16,
                    Some(false) => cfg.zero.comm_dtype = CommDtype::F32,
                    None => {}
                }
            }
            "fp16" => {
                if Section::at("fp16", value)?.bool("enabled")? == Some(true) {
                    return Err(RunError::InvalidConfig(
                        "DeepSpeed config: fp16.enabled is not supported (zeropp trains with bf16 or f32 communication and f32 master weights); use bf16".into(),
                    ));
                }
            }
            "optimizer" => {
                sections::optimizer(Section::at("optimizer", value)?, &mut cfg.optim, &mut warnings)?;
            }
            "zero_optimization" => {
                let switches = sections::zero_optimization(
                    Section::at("zero_optimization", value)?,
                    &mut cfg.zero,
                    &mut warnings,
                )?;
                (qwz_on, qgz_on, loco_param) = (switches.qwz, switches.qgz, switches.loco);
            }
            "scheduler" => {
                warnings.push("`scheduler` is not supported: zeropp uses a constant learning rate".into())
            }
            k if IGNORED_TOP.contains(&k) => {
                warnings.push(format!("`{k}` is not modelled by zeropp and was ignored"))
            }
            k => warnings.push(format!("unknown key `{k}` was ignored")),
        }
    }

    match qwz_on {
        Some(true) => cfg.zero.qwz = Some(cfg.zero.qwz.unwrap_or_else(ZeroConfig::default_qwz_spec)),
        Some(false) => cfg.zero.qwz = None,
        None => {}
    }
    match qgz_on {
        Some(true) => cfg.zero.qgz = Some(cfg.zero.qgz.unwrap_or_default()),
        Some(false) => cfg.zero.qgz = None,
        None => {}
    }
    if let Some(loco) = loco_param {
        match &mut cfg.zero.qgz {
            Some(q) => q.error_feedback = Some(loco),
            None => warnings.push(
                "`zero_optimization.zeropp_loco_param` has no effect with qgZ off and was ignored".into(),
            ),
        }
    }

    let tbs = obj.get("train_batch_size", POSITIVE, &mut warnings)?;
    let micro = obj.get("train_micro_batch_size_per_gpu", POSITIVE, &mut warnings)?;
    let gas = obj.get("gradient_accumulation_steps", POSITIVE, &mut warnings)?;
    if let Some((global, accum)) = resolve_batch(tbs, micro, gas, world)? {
        cfg.global_batch = global;
        cfg.grad_accum = accum;
    }
    Ok(DeepSpeedImport { config: cfg, warnings })
}

/// Reads a DeepSpeed JSON file (see [`from_json_str`]).
pub fn from_file(
    path: &std::path::Path,
    world: usize,
    base: &EngineConfig,
) -> Result<DeepSpeedImport, RunError> {
    let text =
        std::fs::read_to_string(path).map_err(|source| RunError::Io { path: path.to_path_buf(), source })?;
    from_json_str(&text, world, base)
}

#[cfg(test)]
mod tests;
