//! The partition plan of a model: one bucket per model layer (plus the
//! persistent bucket of DeepSpeed's persistence threshold), shards aligned to
//! the quantization groups, and where each model parameter landed.

use zeropp_comm::Topology;
use zeropp_partition::{DType, ParamRegistry, ParamSpec, PartitionPlan, PlanConfig};

use crate::EngineError;
use crate::config::EngineConfig;
use crate::model::Model;

/// Name of the bucket that holds the persistent parameters (the last bucket,
/// after one bucket per model layer), when there are any.
pub const PERSISTENT_BUCKET: &str = "persistent";

/// Builds the [`PartitionPlan`] the engine uses for `model` on `topology`:
/// one bucket per model layer, shards aligned to the quantization groups.
/// With a persistence threshold (`cfg.zero.buckets.param_persistence_threshold`),
/// the parameters of at most that many elements leave their layer's bucket for
/// one last bucket, [`PERSISTENT_BUCKET`] (a layer's bucket may then be empty).
pub fn build_plan<M: Model + ?Sized>(
    model: &M,
    cfg: &EngineConfig,
    topology: Topology,
) -> Result<PartitionPlan, EngineError> {
    check_layers(model)?;
    let mut reg = ParamRegistry::new();
    let threshold = cfg.zero.buckets.param_persistence_threshold;
    let mut persistent = Vec::new();
    for layer in model.layers() {
        let mut params = Vec::new();
        for p in &layer.params {
            let spec = ParamSpec::new(format!("{}.{}", layer.name, p.name), p.shape.clone(), DType::F32);
            if p.numel() <= threshold {
                persistent.push(spec);
            } else {
                params.push(spec);
            }
        }
        reg.push_bucket(layer.name.clone(), params)?;
    }
    if !persistent.is_empty() {
        reg.push_bucket(PERSISTENT_BUCKET, persistent)?;
    }
    let align = shard_align(cfg);
    let mut plan_cfg = PlanConfig::new(align, cfg.zero.hpz_size);
    if cfg.zero.per_tensor_groups {
        // Every parameter starts a quantization group (of qwZ and of qgZ), so no
        // group mixes two tensors: per-tensor scales, as DeepSpeed quantizes.
        plan_cfg = plan_cfg.with_param_align(align);
    }
    Ok(PartitionPlan::new(&reg, topology, plan_cfg)?)
}

/// Checks a model's layer list before it becomes buckets, so a model of a
/// user's own gets a clear error instead of a clash: at least one layer; layer
/// names non-empty, unique, and not [`PERSISTENT_BUCKET`] (reserved for the
/// bucket of DeepSpeed's persistent parameters); parameter names non-empty and
/// unique within their layer; every parameter with at least one element.
///
/// ```
/// use zeropp_engine::engine::check_layers;
/// use zeropp_engine::model::{Gpt, GptConfig};
/// check_layers(&Gpt::new(GptConfig::tiny())?)?;
/// # Ok::<(), zeropp_engine::EngineError>(())
/// ```
pub fn check_layers<M: Model + ?Sized>(model: &M) -> Result<(), EngineError> {
    let bad = |why: String| Err(EngineError::InvalidConfig(format!("model {:?}: {why}", model.name())));
    let layers = model.layers();
    if layers.is_empty() {
        return bad("no layers".into());
    }
    let mut seen = std::collections::HashSet::new();
    for l in layers {
        if l.name.is_empty() {
            return bad("a layer has an empty name".into());
        }
        if l.name == PERSISTENT_BUCKET {
            return bad(format!(
                "layer name `{PERSISTENT_BUCKET}` is reserved (the bucket of the persistent parameters); rename the layer"
            ));
        }
        if !seen.insert(l.name.as_str()) {
            return bad(format!("two layers are named `{}`", l.name));
        }
        let mut names = std::collections::HashSet::new();
        for p in &l.params {
            if p.name.is_empty() {
                return bad(format!("layer `{}` has a parameter with an empty name", l.name));
            }
            if !names.insert(p.name.as_str()) {
                return bad(format!("layer `{}` has two parameters named `{}`", l.name, p.name));
            }
            if p.numel() == 0 {
                return bad(format!(
                    "parameter `{}.{}` of shape {:?} has no elements",
                    l.name, p.name, p.shape
                ));
            }
        }
    }
    Ok(())
}

/// Shard alignment: a common multiple of the qwZ and qgZ group sizes, taking
/// the default group size for a technique that is off
/// ([`ZeroConfig::group_sizes`](crate::ZeroConfig::group_sizes)), so every mode
/// of a comparison with the default specs pads the model the same way.
pub fn shard_align(cfg: &EngineConfig) -> usize {
    fn gcd(a: usize, b: usize) -> usize {
        if b == 0 { a } else { gcd(b, a % b) }
    }
    let (a, b) = cfg.zero.group_sizes();
    let (a, b) = (a.max(2), b.max(2));
    let l = a / gcd(a, b) * b;
    if l.is_multiple_of(2) { l } else { 2 * l }
}

/// Where each model parameter lives in a plan: per model layer, per parameter,
/// `(bucket, index of the parameter in that bucket)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Placement {
    pub(super) params: Vec<Vec<(usize, usize)>>,
    /// The persistent bucket (the one after the layers), if any.
    pub(super) persistent: Option<usize>,
}

impl Placement {
    pub(super) fn of<M: Model + ?Sized>(model: &M, plan: &PartitionPlan) -> Result<Self, EngineError> {
        let layers = model.layers();
        let persistent =
            plan.buckets().iter().position(|b| b.name == PERSISTENT_BUCKET).filter(|&b| b == layers.len());
        let pos = |b: usize, name: &str| -> Option<usize> {
            plan.bucket(b).ok()?.params.iter().position(|p| p.name == name)
        };
        let params = layers
            .iter()
            .enumerate()
            .map(|(l, layer)| {
                layer
                    .params
                    .iter()
                    .map(|p| {
                        let name = format!("{}.{}", layer.name, p.name);
                        pos(l, &name)
                            .map(|i| (l, i))
                            .or_else(|| persistent.and_then(|pb| pos(pb, &name).map(|i| (pb, i))))
                            .ok_or_else(|| {
                                EngineError::Training(format!("parameter {name} is in no bucket of the plan"))
                            })
                    })
                    .collect::<Result<Vec<_>, _>>()
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self { params, persistent })
    }

    /// True when some parameter of layer `l` is persistent.
    pub(super) fn has_persistent(&self, l: usize) -> bool {
        self.params.get(l).is_some_and(|ps| ps.iter().any(|&(b, _)| b != l))
    }
}
