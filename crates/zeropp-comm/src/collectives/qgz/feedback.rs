//! qgZ's error feedback (LoCo, [`ErrorFeedback`]): the residuals of both
//! quantizing hops, stored in f32 or bf16 ([`ResidualPrecision`]).

use std::borrow::Cow;

use zeropp_quant::half::bf16;

/// How [`ErrorFeedback`] stores its residuals.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ResidualPrecision {
    /// f32: 4 bytes per residual element (the device collectives' format).
    #[default]
    F32,
    /// bfloat16, rounded to nearest even after every update: 2 bytes per element,
    /// as DeepSpeed keeps its LoCo error buffers in the 16-bit training dtype. The
    /// arithmetic stays f32; only the stored residual is rounded.
    Bf16,
}

impl ResidualPrecision {
    /// Bytes per stored residual element.
    pub fn bytes(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::Bf16 => 2,
        }
    }
}

/// One residual vector in its storage precision.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Residual {
    F32(Vec<f32>),
    Bf16(Vec<bf16>),
}

impl Default for Residual {
    fn default() -> Self {
        Self::F32(Vec::new())
    }
}

impl Residual {
    pub(super) fn zeros(precision: ResidualPrecision, n: usize) -> Self {
        match precision {
            ResidualPrecision::F32 => Self::F32(vec![0.0; n]),
            ResidualPrecision::Bf16 => Self::Bf16(vec![bf16::ZERO; n]),
        }
    }

    pub(super) fn from_f32(precision: ResidualPrecision, v: Vec<f32>) -> Self {
        match precision {
            ResidualPrecision::F32 => Self::F32(v),
            ResidualPrecision::Bf16 => Self::Bf16(v.into_iter().map(bf16::from_f32).collect()),
        }
    }

    pub(super) fn len(&self) -> usize {
        match self {
            Self::F32(v) => v.len(),
            Self::Bf16(v) => v.len(),
        }
    }

    pub(super) fn precision(&self) -> ResidualPrecision {
        match self {
            Self::F32(_) => ResidualPrecision::F32,
            Self::Bf16(_) => ResidualPrecision::Bf16,
        }
    }

    pub(super) fn to_f32(&self) -> Cow<'_, [f32]> {
        match self {
            Self::F32(v) => Cow::Borrowed(v),
            Self::Bf16(v) => Cow::Owned(v.iter().map(|x| x.to_f32()).collect()),
        }
    }

    pub(super) fn clear(&mut self) {
        match self {
            Self::F32(v) => v.clear(),
            Self::Bf16(v) => v.clear(),
        }
    }

    /// Elements `range` as a mutable view, when in bounds.
    pub(super) fn slice_mut(&mut self, range: std::ops::Range<usize>) -> Option<ResidualMut<'_>> {
        match self {
            Self::F32(v) => v.get_mut(range).map(ResidualMut::F32),
            Self::Bf16(v) => v.get_mut(range).map(ResidualMut::Bf16),
        }
    }
}

/// A mutable window of a [`Residual`].
pub(super) enum ResidualMut<'a> {
    F32(&'a mut [f32]),
    Bf16(&'a mut [bf16]),
}

impl ResidualMut<'_> {
    pub(super) fn len(&self) -> usize {
        match self {
            Self::F32(v) => v.len(),
            Self::Bf16(v) => v.len(),
        }
    }

    pub(super) fn get(&self, i: usize) -> f32 {
        match self {
            Self::F32(v) => v.get(i).copied().unwrap_or(0.0),
            Self::Bf16(v) => v.get(i).map_or(0.0, |x| x.to_f32()),
        }
    }

    pub(super) fn set(&mut self, i: usize, x: f32) {
        match self {
            Self::F32(v) => {
                if let Some(r) = v.get_mut(i) {
                    *r = x;
                }
            }
            Self::Bf16(v) => {
                if let Some(r) = v.get_mut(i) {
                    *r = bf16::from_f32(x);
                }
            }
        }
    }

    pub(super) fn fill_zero(&mut self) {
        match self {
            Self::F32(v) => v.fill(0.0),
            Self::Bf16(v) => v.fill(bf16::ZERO),
        }
    }
}

/// Error feedback for qgZ, as LoCo (DeepSpeed's `zeropp_loco_param`) does it, on
/// **both** quantizing hops. The caller keeps one per gradient buffer.
///
/// At each hop, before quantizing, the hop's residual `e` is added to what is
/// quantized (`c = x + e`); after quantizing, the residual becomes the moving
/// average `e ← β·e + (1 − β)·(c − deq(q(c)))` of the new quantization error, with
/// `β = err_beta` ([`ErrorFeedback::loco`]; `β = 0` is plain error feedback,
/// [`ErrorFeedback::new`]). Hop 1 keeps a residual for every shard of the rank's
/// full gradient (`W·s` elements), hop 2 one for each node partial the rank
/// requantizes (`N·s`; the own node's slot stays zero, that partial is never
/// quantized). The residuals are stored in f32 or, with
/// [`ErrorFeedback::with_precision`], in bf16 (half the memory); they are exposed
/// as f32 ([`ErrorFeedback::state`], [`ErrorFeedback::restore`]) so a checkpoint
/// can resume bit for bit.
///
/// Error feedback is not on by default in the engine: with AdamW it made
/// training worse on held-out text (docs/PERFORMANCE.md, "Fidelity").
///
/// ```
/// use zeropp_comm::collectives::{ErrorFeedback, ResidualPrecision};
/// let fb = ErrorFeedback::loco(0.8).with_precision(ResidualPrecision::Bf16);
/// assert_eq!(fb.precision(), ResidualPrecision::Bf16);
/// assert_eq!(fb.bytes(), 0); // allocated on first use
/// ```
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ErrorFeedback {
    pub(super) residual: Residual,
    pub(super) inter: Residual,
    pub(super) beta: f32,
    pub(super) precision: ResidualPrecision,
}

impl ErrorFeedback {
    /// Plain error feedback (`β = 0`): each residual is the last quantization error.
    pub fn new() -> Self {
        Self::default()
    }

    /// LoCo error feedback with moving-average factor `err_beta` (DeepSpeed's
    /// default is 0.8). Values outside `[0, 1)` are clamped into it.
    pub fn loco(err_beta: f32) -> Self {
        let beta = if err_beta.is_finite() { err_beta.clamp(0.0, 0.999_999) } else { 0.0 };
        Self { beta, ..Self::default() }
    }

    /// This feedback with its residuals stored in `precision` (existing
    /// residuals are converted: exact from bf16 to f32, rounded the other way).
    pub fn with_precision(mut self, precision: ResidualPrecision) -> Self {
        self.precision = precision;
        let (h1, h2) = (self.residual.to_f32().into_owned(), self.inter.to_f32().into_owned());
        self.restore(h1, h2);
        self
    }

    /// The moving-average factor β.
    pub fn beta(&self) -> f32 {
        self.beta
    }

    /// How the residuals are stored.
    pub fn precision(&self) -> ResidualPrecision {
        self.precision
    }

    /// Bytes the stored residuals take now (both hops).
    pub fn bytes(&self) -> usize {
        (self.residual.len() + self.inter.len()) * self.precision.bytes()
    }

    /// The first hop's residual as f32, in padded full-gradient order (`W·⌈n/W⌉`
    /// elements; empty before first use).
    pub fn residual(&self) -> Cow<'_, [f32]> {
        self.residual.to_f32()
    }

    /// The second hop's residual as f32: one `⌈n/W⌉` slot per node, in node order
    /// (`N·⌈n/W⌉` elements; empty before first use or when there is one node).
    pub fn inter_residual(&self) -> Cow<'_, [f32]> {
        self.inter.to_f32()
    }

    /// Both residuals `(hop 1, hop 2)` as f32, for checkpoints.
    pub fn state(&self) -> (Cow<'_, [f32]>, Cow<'_, [f32]>) {
        (self.residual(), self.inter_residual())
    }

    /// Replaces both residuals (from [`ErrorFeedback::state`] of a saved run),
    /// stored in this feedback's precision. Their lengths are checked on the next
    /// collective, which resets a residual whose length does not fit the gradient.
    pub fn restore(&mut self, hop1: Vec<f32>, hop2: Vec<f32>) {
        self.residual = Residual::from_f32(self.precision, hop1);
        self.inter = Residual::from_f32(self.precision, hop2);
    }

    /// Forgets both residuals (LoCo's periodic reset, `reset_T`).
    pub fn reset(&mut self) {
        self.residual.clear();
        self.inter.clear();
    }
}
