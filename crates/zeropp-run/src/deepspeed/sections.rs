//! The two sections of a DeepSpeed config that carry structure: `optimizer`
//! (AdamW / Adam and its params) and `zero_optimization` (stage 3, the ZeRO++
//! switches, LoCo, hpZ and the bucket knobs).

use serde_json::Value;

use super::json::{COUNT, ELEMENTS, FINITE, POSITIVE, Section, type_err};
use crate::RunError;
use zeropp_engine::config::{AdamWConfig, LocoConfig, ZeroConfig};

/// `zero_optimization` keys DeepSpeed defines that have no effect here.
const IGNORED_ZERO: &[&str] = &[
    "overlap_comm",
    "contiguous_gradients",
    "reduce_scatter",
    "allgather_partitions",
    "allgather_bucket_size",
    "stage3_max_reuse_distance",
    "stage3_gather_16bit_weights_on_model_save",
    "sub_group_size",
    "round_robin_gradients",
    "offload_param",
    "offload_optimizer",
    "memory_efficient_linear",
    "mics_shard_size",
];

/// Applies `optimizer` (`o`) to `optim`.
pub(super) fn optimizer(
    o: Section<'_>,
    optim: &mut AdamWConfig,
    warnings: &mut Vec<String>,
) -> Result<(), RunError> {
    let mut ty = "adamw".to_string();
    let mut params = None;
    for (k, v) in o.entries() {
        match k.as_str() {
            "type" => match v {
                Value::String(s) => ty = s.to_ascii_lowercase(),
                _ => return Err(type_err("optimizer.type", "a string", v)),
            },
            "params" => params = Some(Section::at("optimizer.params", v)?),
            _ => warnings.push(format!("`optimizer.{k}` is not supported and was ignored")),
        }
    }
    match ty.as_str() {
        "adamw" => {}
        // DeepSpeed's Adam defaults to decoupled weight decay (adam_w_mode=True).
        "adam" => optim.weight_decay = 0.0,
        other => {
            return Err(RunError::InvalidConfig(format!(
                "DeepSpeed config: optimizer `{other}` is not supported (only AdamW and Adam)"
            )));
        }
    }
    let Some(p) = params else { return Ok(()) };
    for (pk, pv) in p.entries() {
        let slot = match pk.as_str() {
            "lr" => &mut optim.lr,
            "eps" => &mut optim.eps,
            "weight_decay" => &mut optim.weight_decay,
            "betas" => {
                let arr = pv.as_array().filter(|a| a.len() == 2);
                let betas: Option<Vec<f32>> =
                    arr.map(|a| a.iter().filter_map(|x| x.as_f64().map(|x| x as f32)).collect());
                let Some(&[b1, b2]) = betas.as_deref() else {
                    return Err(type_err("optimizer.params.betas", "[beta1, beta2]", pv));
                };
                (optim.beta1, optim.beta2) = (b1, b2);
                continue;
            }
            other => {
                warnings.push(format!("`optimizer.params.{other}` is not supported and was ignored"));
                continue;
            }
        };
        if let Some(v) = p.get(pk, FINITE, warnings)? {
            *slot = v;
        }
    }
    Ok(())
}

/// The ZeRO++ switches of `zero_optimization`, applied after the whole file
/// is read (whatever the key order).
#[derive(Debug, Default)]
pub(super) struct ZeroSwitches {
    /// `zero_quantized_weights`.
    pub(super) qwz: Option<bool>,
    /// `zero_quantized_gradients`.
    pub(super) qgz: Option<bool>,
    /// `zeropp_loco_param`.
    pub(super) loco: Option<LocoConfig>,
}

/// Reads `zero_optimization.zeropp_loco_param`.
fn loco_param(lp: Section<'_>, warnings: &mut Vec<String>) -> Result<LocoConfig, RunError> {
    let mut loco = LocoConfig::default();
    for (lk, _) in lp.entries() {
        match lk.as_str() {
            "err_beta" => loco.err_beta = lp.get(lk, FINITE, warnings)?.unwrap_or(loco.err_beta),
            "reset_T" => loco.reset_t = lp.get(lk, COUNT, warnings)?.unwrap_or(loco.reset_t),
            other => warnings.push(format!("unknown key `{}` was ignored", lp.shown(other))),
        }
    }
    Ok(loco)
}

/// Applies `zero_optimization` (`z`) to `zero`; returns the switches.
pub(super) fn zero_optimization(
    z: Section<'_>,
    zero: &mut ZeroConfig,
    warnings: &mut Vec<String>,
) -> Result<ZeroSwitches, RunError> {
    let mut switches = ZeroSwitches::default();
    let b = &mut zero.buckets;
    for (zk, zv) in z.entries() {
        match zk.as_str() {
            "stage" => match zv.as_u64() {
                Some(3) => zero.stage = 3,
                Some(s) => {
                    return Err(RunError::InvalidConfig(format!(
                        "DeepSpeed config: zero_optimization.stage {s} is not supported (only stage 3)"
                    )));
                }
                None => return Err(type_err("zero_optimization.stage", "an integer", zv)),
            },
            "zero_quantized_weights" => switches.qwz = z.bool(zk)?,
            "zero_quantized_gradients" => switches.qgz = z.bool(zk)?,
            "zeropp_loco_param" => {
                let lp = Section::at("zero_optimization.zeropp_loco_param", zv)?;
                switches.loco = Some(loco_param(lp, warnings)?);
            }
            "zero_hpz_partition_size" => {
                zero.hpz_size = z.get(zk, POSITIVE, warnings)?.unwrap_or(zero.hpz_size);
            }
            "reduce_bucket_size" => match z.get(zk, ELEMENTS, warnings)? {
                Some(0) => return Err(type_err(&z.shown(zk), "a positive integer (elements)", zv)),
                n => b.reduce_bucket_size = n.or(b.reduce_bucket_size),
            },
            "stage3_prefetch_bucket_size" => {
                b.prefetch_bucket_size = z.get(zk, ELEMENTS, warnings)?.or(b.prefetch_bucket_size);
            }
            "stage3_max_live_parameters" => {
                b.max_live_parameters = z.get(zk, ELEMENTS, warnings)?.or(b.max_live_parameters);
            }
            "stage3_param_persistence_threshold" => {
                let n = z.get(zk, ELEMENTS, warnings)?;
                b.param_persistence_threshold = n.unwrap_or(b.param_persistence_threshold);
            }
            k if IGNORED_ZERO.contains(&k) => {
                warnings.push(format!("`zero_optimization.{k}` is not modelled by zeropp and was ignored"));
            }
            k => warnings.push(format!("unknown key `zero_optimization.{k}` was ignored")),
        }
    }
    Ok(switches)
}
