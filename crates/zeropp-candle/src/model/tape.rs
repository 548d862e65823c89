//! One micro-batch's state between forward and backward ([`CandleTape`]) and
//! what each kept stage holds for its backward.

use candle_core::{Tensor, Var};
use zeropp_engine::model::kit::CallOrder;

/// What the forward of one stage keeps for its backward (the stages in
/// [`CandleModel::kept_stages`](super::CandleModel::kept_stages)).
#[derive(Debug)]
pub(super) struct Kept {
    /// The stage's output, or for the last stage the loss (computed once,
    /// in the forward, and differentiated in the backward).
    pub(super) out: Tensor,
    pub(super) vars: Vec<Var>,
    pub(super) input: Option<Var>,
    /// The tied parameters the stage borrows, as Vars (in `borrows` order).
    pub(super) borrowed: Vec<Var>,
}

/// One micro-batch's state between forward and backward (its `Debug` shows
/// the tensors' shapes, the batch's among them, not their values).
#[derive(Debug)]
pub struct CandleTape {
    pub(super) order: CallOrder,
    pub(super) ids: Tensor,
    pub(super) targets: Tensor,
    /// Stage `l`'s input (`l >= 1`) until its backward.
    pub(super) inputs: Vec<Option<Tensor>>,
    /// The output of the last forward so far.
    pub(super) act: Option<Tensor>,
    pub(super) kept: Vec<Option<Kept>>,
    /// d(loss)/d(output) of the stage whose backward is next.
    pub(super) upstream: Option<Tensor>,
    pub(super) loss: f32,
    /// Training (dropout on) or evaluation.
    pub(super) train: bool,
    /// The micro-batch's key (the stages' seeds derive from it).
    pub(super) key: u64,
    /// Tied parameters, by `(owner stage, parameter)`: the owner's gathered
    /// values from its forward, and the later stages' gradients of them.
    pub(super) lent: std::collections::HashMap<(usize, usize), Tensor>,
    pub(super) lent_grads: std::collections::HashMap<(usize, usize), Tensor>,
}
