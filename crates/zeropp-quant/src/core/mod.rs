//! Group-wise drivers shared by the public operations: one pass per group
//! (max, then quantize while the group is in cache), tiling for converted or
//! summed sources, INT4 packing, and the rayon split; the dequantizing side is
//! [`dequant`].

use crate::element::Element;
use crate::error::{QuantError, Result};
use crate::quantized::{AsQuantizedRef, QOut};
use crate::rng;
use crate::simd::{Dispatch, RoundParams, Stoch};
use crate::spec::{
    Bits, NonFinite, Options, PARALLEL_THRESHOLD_BYTES, Parallelism, QuantSpec, Rounding, Scheme,
};

mod dequant;
pub(crate) use dequant::{Mode, dequant_chunk, dequant_range, par_slices};

/// f32 elements in a tile of converted/summed values (32 KiB: stays in L1/L2).
pub(crate) const TILE: usize = 8192;
/// Bytes of i8 scratch for INT4 packing/unpacking.
pub(crate) const QBLK: usize = 4096;
/// Minimum elements per parallel task.
pub(crate) const CHUNK: usize = 64 * 1024;

/// Where the f32 values to quantize come from.
pub(crate) trait Source: Sync {
    /// All values as one f32 slice, when no conversion is needed.
    fn direct(&self) -> Option<&[f32]>;
    /// Writes values `start..start + out.len()` into `out`.
    fn fill(&self, start: usize, out: &mut [f32]);
}

/// A slice of f32 / bf16 / f16.
pub(crate) struct SliceSource<'a, T>(pub(crate) &'a [T]);

impl<T: Element> Source for SliceSource<'_, T> {
    fn direct(&self) -> Option<&[f32]> {
        T::as_f32(self.0)
    }
    fn fill(&self, start: usize, out: &mut [f32]) {
        T::to_f32_slice(&self.0[start..start + out.len()], out);
    }
}

/// The f32 sum of several dequantized inputs (the qgZ fused kernel).
pub(crate) struct SumSource<'a, Q> {
    pub(crate) inputs: &'a [Q],
    pub(crate) d: Dispatch,
}

impl<Q: AsQuantizedRef + Sync> Source for SumSource<'_, Q> {
    fn direct(&self) -> Option<&[f32]> {
        None
    }
    fn fill(&self, start: usize, out: &mut [f32]) {
        let mut scratch = [0u8; QBLK];
        out.fill(0.0);
        for q in self.inputs {
            dequant_range(self.d, q.as_quantized_ref(), start, out, Mode::Add, &mut scratch);
        }
    }
}

/// What every group of one quantization call shares: the kernel, the format
/// and the rounding.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Plan {
    pub(crate) d: Dispatch,
    pub(crate) spec: QuantSpec,
    pub(crate) rounding: Rounding,
    pub(crate) non_finite: NonFinite,
}

impl Plan {
    /// The plan for quantizing to `spec` with kernel `d` and `opts`' rounding
    /// and non-finite policy.
    pub(crate) fn new(d: Dispatch, spec: QuantSpec, opts: &Options) -> Self {
        Self { d, spec, rounding: opts.rounding, non_finite: opts.non_finite }
    }

    /// The parameters of a group whose statistics `st` are (`Err`: the group
    /// holds a non-finite value): the error, or the poisoned group's under
    /// [`NonFinite::Propagate`].
    fn params_or_poison(&self, st: Result<Stats>) -> Result<GroupParams> {
        match (st, self.non_finite) {
            (Ok(st), _) => Ok(params(self.spec.bits(), st)),
            (Err(QuantError::NonFinite { .. }), NonFinite::Propagate) => Ok(GroupParams::POISON),
            (Err(e), _) => Err(e),
        }
    }
}

/// Per-group quantization parameters.
#[derive(Debug, Clone, Copy)]
pub(crate) struct GroupParams {
    /// The multiplier `s`.
    pub(crate) s: f32,
    /// The offset (0 for symmetric).
    pub(crate) offset: f32,
}

impl GroupParams {
    /// A poisoned group's ([`NonFinite::Propagate`]): `s` NaN, so its stored
    /// scale (and offset, for asymmetric groups) is the canonical NaN of
    /// [`crate::wire::POISON_BITS`] and [`emit`] writes its integers as 0.
    const POISON: Self = Self { s: f32::NAN, offset: f32::NAN };

    fn is_poison(self) -> bool {
        self.s.is_nan()
    }

    /// The stored scale `1/s`.
    fn scale(self) -> f32 {
        if self.is_poison() { f32::from_bits(crate::wire::POISON_BITS) } else { 1.0 / self.s }
    }

    /// The stored offset.
    fn offset(self) -> f32 {
        if self.is_poison() { f32::from_bits(crate::wire::POISON_BITS) } else { self.offset }
    }
}

/// Range statistics of (part of) a group.
#[derive(Debug, Clone, Copy)]
enum Stats {
    Sym(f32),
    Asym(f32, f32),
}

impl Stats {
    fn merge(self, other: Stats) -> Stats {
        match (self, other) {
            (Stats::Sym(a), Stats::Sym(b)) => Stats::Sym(a.max(b)),
            (Stats::Asym(l0, h0), Stats::Asym(l1, h1)) => Stats::Asym(l0.min(l1), h0.max(h1)),
            (a, _) => a,
        }
    }
}

/// The error naming the first non-finite element of `x` (global index `base`).
fn first_bad(x: &[f32], base: usize) -> QuantError {
    let (i, v) = x.iter().enumerate().find(|(_, v)| !v.is_finite()).map_or((0, f32::NAN), |(i, &v)| (i, v));
    QuantError::NonFinite { index: base + i, value: v }
}

/// Fused max (and finiteness) pass over `x` (non-empty).
fn stats(d: Dispatch, scheme: Scheme, x: &[f32], base: usize) -> Result<Stats> {
    let r = match scheme {
        Scheme::Asymmetric => d.min_max(x).map(|(l, h)| Stats::Asym(l, h)),
        _ => d.abs_max(x).map(Stats::Sym),
    };
    r.ok_or_else(|| first_bad(x, base))
}

/// `s`, `1/s` and offset from a group's statistics (DeepSpeed's formulas,
/// in f32; the guards only change results that would otherwise be inf/0).
fn params(bits: Bits, st: Stats) -> GroupParams {
    match st {
        Stats::Sym(amax) => {
            let half = (1u32 << (bits.bits() - 1)) as f32;
            let s = if amax == 0.0 { 1.0 } else { half / amax };
            // A tiny (subnormal) amax makes `half / amax` overflow.
            let s = s.min(f32::MAX);
            GroupParams { s, offset: 0.0 }
        }
        Stats::Asym(lo, hi) => {
            // `+ 0.0` maps -0.0 to +0.0 so the result does not depend on
            // which zero a reduction saw first.
            let (lo, hi) = (lo + 0.0, hi + 0.0);
            let full = (1u32 << bits.bits()) as f32;
            let range = hi - lo;
            let s = if hi == lo {
                1.0
            } else if range.is_finite() {
                full / range
            } else {
                // The range overflows f32: compute it in f64.
                (f64::from(full) / (f64::from(hi) - f64::from(lo))) as f32
            };
            let s = s.min(f32::MAX);
            let sum = hi + lo;
            let offset = if sum.is_finite() { sum / 2.0 } else { hi / 2.0 + lo / 2.0 };
            GroupParams { s, offset }
        }
    }
}

/// Statistics + parameters of one whole in-memory group.
fn group_params(plan: &Plan, x: &[f32], base: usize) -> Result<GroupParams> {
    plan.params_or_poison(stats(plan.d, plan.spec.scheme(), x, base))
}

/// Writes packed integers sequentially (INT4 keeps a pending high nibble).
struct Packer<'a> {
    d: Dispatch,
    data: &'a mut [u8],
    pos: usize,
    pending: Option<u8>,
}

impl Packer<'_> {
    fn push4(&mut self, q: &[u8]) {
        let mut q = q;
        if let Some(hi) = self.pending {
            let Some((&first, rest)) = q.split_first() else {
                return;
            };
            self.data[self.pos] = (hi << 4) | (first & 0x0F);
            self.pos += 1;
            self.pending = None;
            q = rest;
        }
        let pairs = q.len() / 2;
        self.d.pack4(&q[..2 * pairs], &mut self.data[self.pos..self.pos + pairs]);
        self.pos += pairs;
        if q.len() % 2 == 1 {
            self.pending = Some(q[q.len() - 1] & 0x0F);
        }
    }

    fn finish(self) {
        if let Some(hi) = self.pending {
            self.data[self.pos] = hi << 4;
        }
    }
}

/// Rounds `x` (global index `base`) into `out` as two's complement bytes.
fn round(plan: Plan, x: &[f32], base: usize, p: GroupParams, out: &mut [u8]) {
    let bits = plan.spec.bits();
    let mut rp = RoundParams {
        s: p.s,
        offset: p.offset,
        qmin: bits.qmin() as f32,
        qmax: bits.qmax() as f32,
        stochastic: None,
    };
    match plan.rounding {
        Rounding::Stochastic { seed } => {
            // Split at multiples of 2^32 so each block has fixed high bits.
            let mut i = 0;
            while i < x.len() {
                let g = (base + i) as u64;
                let lo = g as u32;
                let room = (1u64 << 32) - u64::from(lo);
                let n = (x.len() - i).min(usize::try_from(room).unwrap_or(usize::MAX));
                let (k1, k2) = rng::keys(seed, (g >> 32) as u32);
                rp.stochastic = Some(Stoch { k1, k2, lo });
                plan.d.round(&x[i..i + n], &rp, &mut out[i..i + n]);
                i += n;
            }
        }
        _ => plan.d.round(x, &rp, out),
    }
}

/// Quantizes `x` (global index `base`) and appends it to the packer.
fn emit(
    plan: Plan,
    x: &[f32],
    base: usize,
    p: GroupParams,
    packer: &mut Packer<'_>,
    scratch: &mut [u8; QBLK],
) {
    if p.is_poison() {
        // A poisoned group's integers are 0 (its NaN scale carries the news).
        match plan.spec.bits() {
            Bits::Int8 => {
                packer.data[packer.pos..packer.pos + x.len()].fill(0);
                packer.pos += x.len();
            }
            Bits::Int4 => {
                for c in x.chunks(QBLK) {
                    let s = &mut scratch[..c.len()];
                    s.fill(0);
                    packer.push4(s);
                }
            }
        }
        return;
    }
    match plan.spec.bits() {
        Bits::Int8 => {
            let out = &mut packer.data[packer.pos..packer.pos + x.len()];
            round(plan, x, base, p, out);
            packer.pos += x.len();
        }
        Bits::Int4 => {
            for (k, c) in x.chunks(QBLK).enumerate() {
                let s = &mut scratch[..c.len()];
                round(plan, c, base + k * QBLK, p, s);
                packer.push4(s);
            }
        }
    }
}

/// Stores group `g`'s parameters.
fn put(out: &mut QOut<'_>, g: usize, p: GroupParams) {
    out.scales.set(g, p.scale());
    if let Some(o) = out.offsets.as_mut() {
        o.set(g, p.offset());
    }
}

/// Quantizes elements `start..end` (group-aligned; even for INT4) of `src`
/// on the calling thread into `out`, whose first group/byte is `start`'s.
fn quantize_seq<S: Source>(plan: Plan, src: &S, start: usize, end: usize, out: QOut<'_>) -> Result<()> {
    let (d, spec) = (plan.d, &plan.spec);
    let gs = spec.group_size();
    let QOut { data, scales, offsets } = out;
    let mut params_out = QOut { data: &mut [], scales, offsets };
    let mut packer = Packer { d, data, pos: 0, pending: None };
    let mut scratch = [0u8; QBLK];
    let mut g = 0usize;
    let mut pos = start;
    if let Some(all) = src.direct() {
        while pos < end {
            let ge = (pos + gs).min(end);
            let x = &all[pos..ge];
            let p = group_params(&plan, x, pos)?;
            put(&mut params_out, g, p);
            // The group after next starts loading while this one is rounded (INT8
            // at 256 MiB, one thread, of memcpy: none 0.60-0.66x, one group ahead
            // 0.75-0.78x, two 0.78-0.87x, four 0.76-0.79x; docs/PERFORMANCE.md).
            d.prefetch(all.get((ge + gs).min(end)..(ge + 2 * gs).min(end)).unwrap_or_default());
            emit(plan, x, pos, p, &mut packer, &mut scratch);
            g += 1;
            pos = ge;
        }
    } else if gs <= TILE {
        let mut tile = [0f32; TILE];
        while pos < end {
            let te = (pos + (TILE / gs) * gs).min(end);
            let t = &mut tile[..te - pos];
            src.fill(pos, t);
            let mut a = 0;
            while a < t.len() {
                let b = (a + gs).min(t.len());
                let x = &t[a..b];
                let p = group_params(&plan, x, pos + a)?;
                put(&mut params_out, g, p);
                emit(plan, x, pos + a, p, &mut packer, &mut scratch);
                g += 1;
                a = b;
            }
            pos = te;
        }
    } else {
        // Groups larger than a tile: two streaming passes per group.
        let mut tile = [0f32; TILE];
        while pos < end {
            let ge = (pos + gs).min(end);
            let mut acc: Result<Option<Stats>> = Ok(None);
            let mut a = pos;
            while a < ge {
                let b = (a + TILE).min(ge);
                let t = &mut tile[..b - a];
                src.fill(a, t);
                acc = match (acc, stats(d, spec.scheme(), t, a)) {
                    (Ok(prev), Ok(s)) => Ok(Some(prev.map_or(s, |x| x.merge(s)))),
                    // The first non-finite tile decides the group.
                    (Err(e), _) | (Ok(_), Err(e)) => Err(e),
                };
                if acc.is_err() {
                    break;
                }
                a = b;
            }
            let p = plan.params_or_poison(acc.map(|st| st.unwrap_or(Stats::Sym(0.0))))?;
            put(&mut params_out, g, p);
            let mut a = pos;
            while a < ge {
                let b = (a + TILE).min(ge);
                let t = &mut tile[..b - a];
                src.fill(a, t);
                emit(plan, t, a, p, &mut packer, &mut scratch);
                a = b;
            }
            g += 1;
            pos = ge;
        }
    }
    packer.finish();
    Ok(())
}

/// Whether to use rayon for `len` elements.
pub(crate) fn use_parallel(par: Parallelism, len: usize) -> bool {
    par == Parallelism::Auto
        && len.saturating_mul(4) >= PARALLEL_THRESHOLD_BYTES
        && rayon::current_num_threads() > 1
}

/// Quantizes `start..end` of `src` into `out`, splitting across rayon
/// workers at group boundaries (even element indices for INT4) when `par`.
pub(crate) fn quantize_range<S: Source>(
    plan: Plan,
    src: &S,
    start: usize,
    end: usize,
    out: QOut<'_>,
    par: bool,
) -> Result<()> {
    let spec = &plan.spec;
    let n = end - start;
    let gs = spec.group_size();
    let unit = if spec.bits() == Bits::Int4 && gs % 2 == 1 { gs.saturating_mul(2) } else { gs };
    let units = n / unit;
    if !par || n < 2 * CHUNK || units < 2 {
        return quantize_seq(plan, src, start, end, out);
    }
    let mid = start + (units / 2) * unit;
    let (lo, hi) = out.split_at((mid - start) / gs, spec.data_len(mid - start));
    let (a, b) = rayon::join(
        || quantize_range(plan, src, start, mid, lo, true),
        || quantize_range(plan, src, mid, end, hi, true),
    );
    a.and(b)
}
