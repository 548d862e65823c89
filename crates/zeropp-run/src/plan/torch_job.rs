//! What a PyTorch job is, for the planner: the mode it shards with
//! ([`TorchMode`]), the dtypes on the wire ([`Precision`]), the backend
//! ([`Backend`]) and how it calls FSDP2 ([`Sharding`]). Both the byte model
//! (`fsdp2.rs`) and the memory model (`fsdp2_memory.rs`) read them.

use super::decoder::Decoder;
use crate::{Result, RunError};

/// What a PyTorch job shards with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum TorchMode {
    /// FSDP2's default: flat all-gathers and reduce-scatters over the world.
    Fsdp2,
    /// FSDP2 with `reshard_after_forward` set to the GPUs per node: the
    /// backward gather stays in the node.
    Fsdp2Hpz,
    /// FSDP2 with `zeropp.torch.enable` (qwZ, zeropp's hpZ, qgZ): the README's recipe.
    ZeroppTorch,
}

impl TorchMode {
    /// Every mode, in the order of the tables.
    pub const ALL: [TorchMode; 3] = [TorchMode::Fsdp2, TorchMode::Fsdp2Hpz, TorchMode::ZeroppTorch];

    /// The name `--mode` and the JSON use.
    pub fn name(self) -> &'static str {
        match self {
            TorchMode::Fsdp2 => "fsdp2",
            TorchMode::Fsdp2Hpz => "fsdp2-hpz",
            TorchMode::ZeroppTorch => "zeropp-torch",
        }
    }

    /// The mode called `name`.
    ///
    /// ```
    /// use zeropp_run::plan::TorchMode;
    /// assert_eq!(TorchMode::parse("zeropp-torch")?, TorchMode::ZeroppTorch);
    /// assert!(TorchMode::parse("zeropp").is_err()); // the engine's, not FSDP2's
    /// # Ok::<(), zeropp_run::RunError>(())
    /// ```
    pub fn parse(name: &str) -> Result<Self> {
        Self::ALL.into_iter().find(|m| m.name() == name.trim()).ok_or_else(|| {
            let known: Vec<&str> = Self::ALL.iter().map(|m| m.name()).collect();
            RunError::InvalidConfig(format!(
                "--mode `{name}`: not a mode of --framework fsdp2 (known: {})",
                known.join(", ")
            ))
        })
    }
}

/// Bytes per element of the parameters FSDP2 gathers (`MixedPrecisionPolicy`'s
/// `param_dtype`) and of the gradients it reduces (`reduce_dtype`; FSDP2's
/// default is the parameters' dtype).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Precision {
    /// Gathered parameters: 2 (bf16, fp16) or 4 (fp32).
    pub param_bytes: usize,
    /// Reduced gradients: 2 or 4.
    pub reduce_bytes: usize,
}

impl Precision {
    /// `bf16`, `fp16` or `fp32` as bytes per element.
    pub fn dtype_bytes(name: &str) -> Result<usize> {
        match name.trim() {
            "bf16" | "bfloat16" | "fp16" | "float16" => Ok(2),
            "fp32" | "float32" => Ok(4),
            other => Err(RunError::InvalidConfig(format!("dtype `{other}`: expected bf16, fp16 or fp32"))),
        }
    }
}

/// The torch.distributed backend: how its collectives load the links.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Backend {
    /// NCCL (GPUs): all-gathers and reduce-scatters as rings.
    #[default]
    Nccl,
    /// gloo (CPUs): all-gathers as rings; a reduce-scatter is an all-reduce of
    /// the whole input (a ring: twice a reduce-scatter's pieces) from which each
    /// rank keeps its chunk (`ProcessGroupGloo::reduce_scatter_tensor_coalesced`).
    Gloo,
}

impl Backend {
    /// `nccl` or `gloo`.
    pub fn parse(s: &str) -> Result<Self> {
        match s.trim() {
            "nccl" => Ok(Self::Nccl),
            "gloo" => Ok(Self::Gloo),
            other => Err(RunError::InvalidConfig(format!("--backend `{other}`: expected nccl or gloo"))),
        }
    }
}

/// How the job calls FSDP2, beyond the mode: what the byte model needs of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sharding {
    /// The dtypes on the wire.
    pub precision: Precision,
    /// The root is given `reshard_after_forward` as the layers are
    /// (`fully_shard(model, reshard_after_forward=...)`), so it reshards after
    /// its forward and gathers again in the backward; FSDP2's default
    /// (`fully_shard(model)`) keeps it gathered from its forward to its backward.
    pub root_reshards: bool,
    /// The backend, for the time model (the bytes handed over are the same).
    pub backend: Backend,
}

/// A job's sizes are in range: its decoder's shape, at least one node of at
/// least one GPU and at most 2^20 GPUs, and 2 or 4 bytes an element on the wire.
pub(crate) fn check_job(d: &Decoder, nodes: usize, local: usize, pr: Precision) -> Result<()> {
    d.check()?;
    if nodes == 0 || local == 0 || nodes.saturating_mul(local) > 1 << 20 {
        return Err(RunError::InvalidConfig(format!(
            "cluster {nodes} x {local}: expected 1 to 2^20 GPUs, at least one a node"
        )));
    }
    for b in [pr.param_bytes, pr.reduce_bytes] {
        if b != 2 && b != 4 {
            return Err(RunError::InvalidConfig(format!("{b} bytes an element: expected 2 or 4")));
        }
    }
    Ok(())
}
