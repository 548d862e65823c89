//! The randomized Hadamard transform that smooths outliers before a
//! quantization (SDP4Bit's gradient smoothing), and the quantizer fused with it.
//!
//! A vector is cut into groups of `g` elements (`g` a power of two, the
//! quantization group size). Each whole group is rotated by the orthonormal
//! matrix `R = H·D / √g`: `D` flips the sign of element `i` when bit `i` of a
//! seeded pseudo-random stream is set, `H` is the `g × g` Walsh–Hadamard matrix
//! (entries ±1, `H·H = g·I`), applied as `log2 g` butterfly stages. The inverse
//! is `R⁻¹ = D·H / √g`. A partial last group is left as it is.
//!
//! Why: a symmetric quantizer's step is set by the group's largest magnitude,
//! so one outlier coarsens the other `g − 1` values. After the rotation every
//! output is a ±-weighted mix of the whole group, so the mass of an outlier is
//! spread over the group and the step shrinks towards `‖x‖₂ / √g`, while the
//! error's L2 norm is unchanged by the (orthonormal) inverse.
//!
//! The transform is linear, and the signs depend only on `(seed, position)`:
//! encodings of the same positions made by different ranks with the same seed
//! can be summed in the rotated domain (the fused qgZ kernel needs no change)
//! and rotated back once.
//!
//! **Positions.** Element `i` of a call's slice has stream position
//! `position + i`; its sign is bit `(position + i) mod 32` of
//! `lowbias32(lowbias32(w ^ k1) ^ k2)` for word `w = (position + i) / 32`, with
//! `(k1, k2)` derived from `seed` (domain-separated from stochastic rounding's
//! stream) and the word's high bits, as in [`crate::rng`].
//!
//! **Arithmetic.** Forward: flip, stages `h = 1, 2, …, g/2` (`(a, b) → (a + b,
//! a − b)`), multiply by `1/√g` (rounded to f32; exact when `g` is a power of
//! four). Inverse: the stages, the multiply, then the flip. Every kernel (scalar,
//! AVX2, AVX-512, NEON, CUDA) performs these operations in this order, so the
//! results are bit-identical.
//!
//! ```
//! use zeropp_quant::{Hadamard, Options, QuantSpec, encoded_len};
//! use zeropp_quant::hadamard::{dequantize_hadamard_into, quantize_hadamard_to_wire};
//! let spec = QuantSpec::int4(64)?;
//! let h = Hadamard::for_spec(&spec, 42)?;
//! // One outlier in an otherwise small group.
//! let mut x = vec![0.01f32; 64];
//! x[5] = 4.0;
//! let mut wire = vec![0u8; encoded_len(spec, x.len())];
//! quantize_hadamard_to_wire(&x, spec, &h, 0, &Options::default(), &mut wire)?;
//! let q = zeropp_quant::QuantizedRef::from_bytes(&wire)?;
//! let mut y = vec![0.0f32; 64];
//! dequantize_hadamard_into(&q, &mut y, &h, 0, &Options::default())?;
//! // The small values survive INT4: without the rotation they all round to 0.
//! let err: f32 = x.iter().zip(&y).map(|(a, b)| (a - b).powi(2)).sum::<f32>().sqrt();
//! let plain = zeropp_quant::dequantize(&zeropp_quant::quantize(&x, spec, &Options::default())?, &Options::default())?;
//! let err_plain: f32 = x.iter().zip(&plain).map(|(a, b)| (a - b).powi(2)).sum::<f32>().sqrt();
//! assert!(err < err_plain);
//! // The transform alone is its own inverse's inverse, up to f32 rounding.
//! let mut z = x.clone();
//! h.forward(&mut z, 7, &Options::default())?;
//! h.inverse(&mut z, 7, &Options::default())?;
//! assert!(x.iter().zip(&z).all(|(a, b)| (a - b).abs() < 1e-6));
//! # Ok::<(), zeropp_quant::QuantError>(())
//! ```

use crate::core::{self, Mode, Plan, SliceSource, Source, TILE};
use crate::element::Element;
use crate::error::{QuantError, Result};
use crate::quantized::{AsQuantizedRef, QuantizedRef};
use crate::rng;
use crate::simd::Dispatch;
use crate::spec::{Options, QuantSpec};

/// The largest group a Hadamard rotation accepts: the quantizer's tile (a
/// rotated group is transformed while it sits in the tile).
pub const MAX_GROUP: usize = TILE;

/// Folded into the seed so the sign stream never equals a stochastic-rounding
/// stream of the same seed.
const SIGN_DOMAIN: u64 = 0x4841_4441_4D41_5244; // "HADAMARD"

/// A randomized Hadamard rotation per group of `group_size` elements, with the
/// sign stream of `seed` (see the [module docs](self)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Hadamard {
    group_size: usize,
    seed: u64,
}

impl Hadamard {
    /// A rotation of groups of `group_size` elements: a power of two, at most
    /// [`MAX_GROUP`]; otherwise [`QuantError::HadamardGroupSize`].
    pub fn new(group_size: usize, seed: u64) -> Result<Self> {
        if !group_size.is_power_of_two() || group_size > MAX_GROUP {
            return Err(QuantError::HadamardGroupSize { got: group_size, max: MAX_GROUP });
        }
        Ok(Self { group_size, seed })
    }

    /// The rotation matching `spec`'s quantization groups.
    pub fn for_spec(spec: &QuantSpec, seed: u64) -> Result<Self> {
        Self::new(spec.group_size(), seed)
    }

    /// Elements per rotated group.
    pub const fn group_size(&self) -> usize {
        self.group_size
    }

    /// The seed of the sign stream.
    pub const fn seed(&self) -> u64 {
        self.seed
    }

    /// This rotation with another seed.
    #[must_use]
    pub const fn with_seed(self, seed: u64) -> Self {
        Self { seed, ..self }
    }

    /// `1/√g`, rounded to f32 (the last multiply of every kernel).
    pub(crate) fn scale(&self) -> f32 {
        (1.0 / (self.group_size as f64).sqrt()) as f32
    }

    /// Rotates every whole group of `x` in place (the groups start at `x[0]`;
    /// `x[0]` has stream position `position`). A partial last group is left as
    /// it is. Non-finite values spread over their group.
    pub fn forward(&self, x: &mut [f32], position: u64, opts: &Options) -> Result<()> {
        self.apply(x, position, opts, false)
    }

    /// The inverse of [`Hadamard::forward`] with the same `position`.
    pub fn inverse(&self, x: &mut [f32], position: u64, opts: &Options) -> Result<()> {
        self.apply(x, position, opts, true)
    }

    fn apply(&self, x: &mut [f32], position: u64, opts: &Options, inverse: bool) -> Result<()> {
        let d = Dispatch::resolve(opts.kernel)?;
        let par = core::use_parallel(opts.parallelism, x.len());
        par_groups(x, 0, self.group_size, par, &|start, part: &mut [f32]| {
            self.rotate_groups(d, part, position.wrapping_add(start as u64), inverse);
        });
        Ok(())
    }

    /// Rotates the whole groups of `x` (groups start at `x[0]`, at stream
    /// position `position`) on the calling thread.
    pub(crate) fn rotate_groups(&self, d: Dispatch, x: &mut [f32], position: u64, inverse: bool) {
        let g = self.group_size;
        let scale = self.scale();
        let mut signs = [0u32; MAX_GROUP / 32];
        let words = g.div_ceil(32);
        let mut stream = SignStream::new(self.seed, d);
        for (k, group) in x.chunks_exact_mut(g).enumerate() {
            let pos = position.wrapping_add((k * g) as u64);
            stream.words(pos, &mut signs[..words]);
            d.fwht(group, &signs[..words], scale, inverse);
        }
    }
}

/// The sign stream of one seed: the keys of the current block of 2^32 words
/// are kept, and words are hashed `WIDTH` at a time by the kernel.
struct SignStream {
    seed: u64,
    d: Dispatch,
    hi: u32,
    keys: (u32, u32),
}

impl SignStream {
    fn new(seed: u64, d: Dispatch) -> Self {
        Self { seed, d, hi: 0, keys: rng::keys(seed ^ SIGN_DOMAIN, 0) }
    }

    /// The sign words `first .. first + out.len()` (word `w` holds positions
    /// `32w .. 32w + 32`).
    fn raw_words(&mut self, first: u64, out: &mut [u32]) {
        let mut done = 0;
        while done < out.len() {
            let w = first.wrapping_add(done as u64);
            let hi = (w >> 32) as u32;
            if hi != self.hi {
                self.hi = hi;
                self.keys = rng::keys(self.seed ^ SIGN_DOMAIN, hi);
            }
            // Up to the end of this block of 2^32 words (the keys change there).
            let room = (1u64 << 32) - (w & 0xFFFF_FFFF);
            let take = (out.len() - done).min(usize::try_from(room).unwrap_or(usize::MAX));
            self.d.hash_words(self.keys.0, self.keys.1, w as u32, &mut out[done..done + take]);
            done += take;
        }
    }

    /// The sign bits of positions `pos .. pos + 32·out.len()`: bit `k % 32` of
    /// `out[k / 32]` for position `pos + k`.
    fn words(&mut self, pos: u64, out: &mut [u32]) {
        let (first, sh) = (pos / 32, (pos % 32) as u32);
        if sh == 0 {
            self.raw_words(first, out);
            return;
        }
        let mut buf = [0u32; MAX_GROUP / 32 + 1];
        let words = &mut buf[..out.len() + 1];
        self.raw_words(first, words);
        for (w, o) in out.iter_mut().enumerate() {
            *o = (words[w] >> sh) | (words[w + 1] << (32 - sh));
        }
    }
}

/// The sign bits of the `g` positions from `pos` (bit `k % 32` of word `k / 32`
/// for position `pos + k`), for
/// other implementations of the transform to be checked against.
pub fn sign_bits(seed: u64, pos: u64, g: usize) -> Vec<u32> {
    let mut out = vec![0u32; g.div_ceil(32)];
    // The scalar kernel: this is what other implementations are checked against.
    let mut stream = SignStream::new(seed, Dispatch::scalar());
    for (k, chunk) in out.chunks_mut(MAX_GROUP / 32).enumerate() {
        stream.words(pos.wrapping_add((k * MAX_GROUP) as u64), chunk);
    }
    out
}

/// Runs `f(start, part)` over `x` cut at multiples of `g` (in parallel halves when `par`).
fn par_groups<F>(x: &mut [f32], start: usize, g: usize, par: bool, f: &F)
where
    F: Fn(usize, &mut [f32]) + Sync,
{
    let groups = x.len() / g;
    if !par || x.len() < 2 * core::CHUNK || groups < 2 {
        f(start, x);
        return;
    }
    let mid = groups / 2 * g;
    let (a, b) = x.split_at_mut(mid);
    rayon::join(|| par_groups(a, start, g, true, f), || par_groups(b, start + mid, g, true, f));
}

/// `input`'s values rotated group by group as the quantizer reads them.
struct Rotated<'a, T> {
    input: SliceSource<'a, T>,
    h: Hadamard,
    position: u64,
    d: Dispatch,
}

impl<T: Element> Source for Rotated<'_, T> {
    fn direct(&self) -> Option<&[f32]> {
        None
    }

    /// `start` is a group boundary and `out` whole groups but for the
    /// vector's partial last group (the quantizer's tiling guarantees both).
    fn fill(&self, start: usize, out: &mut [f32]) {
        self.input.fill(start, out);
        self.h.rotate_groups(self.d, out, self.position.wrapping_add(start as u64), false);
    }
}

fn check_group(spec: &QuantSpec, h: &Hadamard) -> Result<()> {
    if spec.group_size() == h.group_size() {
        Ok(())
    } else {
        Err(QuantError::HadamardMismatch { rotation: h.group_size(), spec: spec.group_size() })
    }
}

/// Rotates `input` (see [`Hadamard::forward`]; `input[0]` at stream position
/// `position`) and quantizes the result straight into its wire encoding in
/// `buf`, in one pass: each tile of whole groups is rotated in a cache-sized
/// buffer and quantized from there. `h` must have `spec`'s group size. Returns
/// the bytes written. The encoding is an ordinary one (of the rotated values):
/// [`dequantize_hadamard_into`] with the same `h` and `position` undoes both.
///
/// A non-finite input is [`QuantError::NonFinite`] naming its index in `input`.
pub fn quantize_hadamard_to_wire<T: Element>(
    input: &[T],
    spec: QuantSpec,
    h: &Hadamard,
    position: u64,
    opts: &Options,
    buf: &mut [u8],
) -> Result<usize> {
    check_group(&spec, h)?;
    let d = Dispatch::resolve(opts.kernel)?;
    let (out, total) = crate::ops::wire_out(buf, &spec, input.len())?;
    let par = core::use_parallel(opts.parallelism, input.len());
    let src = Rotated { input: SliceSource(input), h: *h, position, d };
    match core::quantize_range(Plan::new(d, spec, opts), &src, 0, input.len(), out, par) {
        Ok(()) => Ok(total),
        Err(QuantError::NonFinite { .. }) => Err(first_non_finite(input)),
        Err(e) => Err(e),
    }
}

/// The error naming `input`'s first non-finite element (a rotation spreads it
/// over its group, so the quantizer's index would point elsewhere).
fn first_non_finite<T: Element>(input: &[T]) -> QuantError {
    let (index, value) =
        input.iter().map(|v| v.to_f32()).enumerate().find(|(_, v)| !v.is_finite()).unwrap_or((0, f32::NAN));
    QuantError::NonFinite { index, value }
}

/// Dequantizes `q` (an encoding of rotated values, from
/// [`quantize_hadamard_to_wire`] or a fused reduce of such encodings) and
/// rotates it back into `out` (`q.len()` elements).
pub fn dequantize_hadamard_into<Q: AsQuantizedRef + ?Sized>(
    q: &Q,
    out: &mut [f32],
    h: &Hadamard,
    position: u64,
    opts: &Options,
) -> Result<()> {
    dequant_rotated(q.as_quantized_ref(), out, h, position, opts, Mode::Write)
}

/// Like [`dequantize_hadamard_into`], but adds the rotated-back values to
/// `acc` (`acc[i] += x̂[i]`, in f32).
pub fn dequantize_hadamard_add<Q: AsQuantizedRef + ?Sized>(
    q: &Q,
    acc: &mut [f32],
    h: &Hadamard,
    position: u64,
    opts: &Options,
) -> Result<()> {
    dequant_rotated(q.as_quantized_ref(), acc, h, position, opts, Mode::Add)
}

fn dequant_rotated(
    q: QuantizedRef<'_>,
    out: &mut [f32],
    h: &Hadamard,
    position: u64,
    opts: &Options,
    mode: Mode,
) -> Result<()> {
    check_group(&q.spec(), h)?;
    if q.len() != out.len() {
        return Err(QuantError::LengthMismatch {
            what: "dequantize_hadamard output",
            expected: q.len(),
            actual: out.len(),
        });
    }
    let d = Dispatch::resolve(opts.kernel)?;
    let par = core::use_parallel(opts.parallelism, q.len());
    let g = h.group_size();
    par_groups(out, 0, g, par, &|start, part: &mut [f32]| {
        let mut scratch = [0u8; core::QBLK];
        let mut tile = [0f32; TILE];
        let per_tile = TILE / g * g;
        for (k, sub) in part.chunks_mut(per_tile).enumerate() {
            let at = start + k * per_tile;
            let t = &mut tile[..sub.len()];
            core::dequant_range(d, q, at, t, Mode::Write, &mut scratch);
            h.rotate_groups(d, t, position.wrapping_add(at as u64), true);
            match mode {
                Mode::Write => sub.copy_from_slice(t),
                Mode::Add => sub.iter_mut().zip(t.iter()).for_each(|(a, b)| *a += b),
            }
        }
    });
    Ok(())
}
