//! Quantized values: owned [`Quantized`] and the zero-copy [`QuantizedRef`].

use crate::error::{DecodeError, QuantError, Result};
use crate::spec::{Bits, QuantSpec};
use crate::wire;

/// Per-group parameters, either native f32 or little-endian bytes in a
/// wire buffer (which may be unaligned).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Params<'a> {
    F32(&'a [f32]),
    Le(&'a [u8]),
}

impl Params<'_> {
    #[inline]
    pub(crate) fn get(&self, g: usize) -> f32 {
        match self {
            Params::F32(s) => s[g],
            Params::Le(b) => {
                let mut a = [0u8; 4];
                a.copy_from_slice(&b[4 * g..4 * g + 4]);
                f32::from_le_bytes(a)
            }
        }
    }

    fn len(&self) -> usize {
        match self {
            Params::F32(s) => s.len(),
            Params::Le(b) => b.len() / 4,
        }
    }
}

/// Mutable per-group parameters (see [`Params`]).
#[derive(Debug)]
pub(crate) enum ParamsMut<'a> {
    F32(&'a mut [f32]),
    Le(&'a mut [u8]),
}

impl<'a> ParamsMut<'a> {
    #[inline]
    pub(crate) fn set(&mut self, g: usize, v: f32) {
        match self {
            ParamsMut::F32(s) => s[g] = v,
            ParamsMut::Le(b) => b[4 * g..4 * g + 4].copy_from_slice(&v.to_le_bytes()),
        }
    }

    pub(crate) fn split_at(self, g: usize) -> (ParamsMut<'a>, ParamsMut<'a>) {
        match self {
            ParamsMut::F32(s) => {
                let (a, b) = s.split_at_mut(g);
                (ParamsMut::F32(a), ParamsMut::F32(b))
            }
            ParamsMut::Le(s) => {
                let (a, b) = s.split_at_mut(4 * g);
                (ParamsMut::Le(a), ParamsMut::Le(b))
            }
        }
    }
}

/// Destination of a quantization: packed data and per-group parameters.
#[derive(Debug)]
pub(crate) struct QOut<'a> {
    pub(crate) data: &'a mut [u8],
    pub(crate) scales: ParamsMut<'a>,
    pub(crate) offsets: Option<ParamsMut<'a>>,
}

impl<'a> QOut<'a> {
    /// Splits after `groups` groups and `bytes` data bytes.
    pub(crate) fn split_at(self, groups: usize, bytes: usize) -> (QOut<'a>, QOut<'a>) {
        let (d0, d1) = self.data.split_at_mut(bytes);
        let (s0, s1) = self.scales.split_at(groups);
        let (o0, o1) = match self.offsets {
            Some(o) => {
                let (a, b) = o.split_at(groups);
                (Some(a), Some(b))
            }
            None => (None, None),
        };
        (QOut { data: d0, scales: s0, offsets: o0 }, QOut { data: d1, scales: s1, offsets: o1 })
    }
}

/// A borrowed, validated quantized vector: packed data, per-group scales
/// (and offsets), length and spec.
///
/// Obtained zero-copy from wire bytes with [`QuantizedRef::from_bytes`] or
/// from an owned value with [`Quantized::view`]. Every dequantizing function
/// accepts it (through [`AsQuantizedRef`]). Its contents have been checked,
/// so dequantizing it cannot fail or read out of bounds.
#[derive(Debug, Clone, Copy)]
pub struct QuantizedRef<'a> {
    spec: QuantSpec,
    len: usize,
    data: &'a [u8],
    scales: Params<'a>,
    offsets: Option<Params<'a>>,
}

/// An owned quantized vector: packed data bytes, per-group scales (and
/// offsets for the asymmetric scheme), length and spec.
///
/// ```
/// use zeropp_quant::{quantize, Options, QuantSpec, Quantized};
/// let x: Vec<f32> = (0..100).map(|i| (i as f32 * 0.37).sin()).collect();
/// let q = quantize(&x, QuantSpec::int8(32)?, &Options::default())?;
/// let bytes = q.to_bytes();
/// assert_eq!(bytes.len(), zeropp_quant::encoded_len(q.spec(), q.len()));
/// let back = Quantized::from_bytes(&bytes)?;
/// assert_eq!(back, q);
/// // Or write into a caller buffer:
/// let mut buf = vec![0u8; bytes.len()];
/// assert_eq!(q.write_into(&mut buf)?, bytes.len());
/// assert_eq!(buf, bytes);
/// # Ok::<(), zeropp_quant::QuantError>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct Quantized {
    spec: QuantSpec,
    len: usize,
    data: Vec<u8>,
    scales: Vec<f32>,
    offsets: Vec<f32>,
}

/// Anything that can be viewed as a [`QuantizedRef`]: [`Quantized`],
/// [`QuantizedRef`] and references to them.
pub trait AsQuantizedRef {
    /// The borrowed view.
    fn as_quantized_ref(&self) -> QuantizedRef<'_>;
}

impl AsQuantizedRef for Quantized {
    fn as_quantized_ref(&self) -> QuantizedRef<'_> {
        self.view()
    }
}

impl AsQuantizedRef for QuantizedRef<'_> {
    fn as_quantized_ref(&self) -> QuantizedRef<'_> {
        *self
    }
}

impl<T: AsQuantizedRef + ?Sized> AsQuantizedRef for &T {
    fn as_quantized_ref(&self) -> QuantizedRef<'_> {
        (**self).as_quantized_ref()
    }
}

/// Checks scales, offsets and INT4 padding of a candidate value.
fn validate(
    spec: &QuantSpec,
    len: usize,
    data: &[u8],
    scales: Params<'_>,
    offsets: Option<Params<'_>>,
) -> Result<(), DecodeError> {
    let groups = spec.num_groups(len);
    if data.len() != spec.data_len(len) {
        return Err(DecodeError::Inconsistent("data length does not match spec and len"));
    }
    if scales.len() != groups {
        return Err(DecodeError::Inconsistent("scale count does not match the group count"));
    }
    match (spec.scheme().has_offsets(), &offsets) {
        (true, Some(o)) if o.len() == groups => {}
        (false, None) => {}
        _ => {
            return Err(DecodeError::Inconsistent("offset count does not match the scheme and group count"));
        }
    }
    let poisoned = |v: f32| v.to_bits() == crate::wire::POISON_BITS;
    for g in 0..groups {
        let s = scales.get(g);
        // A poisoned group is poisoned whole: its offset too, where it has one.
        let poison = poisoned(s) && offsets.as_ref().is_none_or(|o| poisoned(o.get(g)));
        if !(s.is_finite() && s > 0.0 || poison) {
            return Err(DecodeError::BadScale { group: g, value: s });
        }
    }
    if let Some(o) = offsets {
        for g in 0..groups {
            let v = o.get(g);
            // A poisoned offset only beside its group's poisoned scale.
            if !(v.is_finite() || poisoned(v) && poisoned(scales.get(g))) {
                return Err(DecodeError::BadOffset { group: g, value: v });
            }
        }
    }
    if spec.bits() == Bits::Int4 && len % 2 == 1 && data.last().is_some_and(|b| b & 0x0F != 0) {
        return Err(DecodeError::BadPadding);
    }
    Ok(())
}

/// The accessors [`QuantizedRef`], [`Quantized`] and the CUDA module's
/// `GpuQuantized` share: each holds a `spec` and a `len`.
macro_rules! shape_accessors {
    () => {
        /// The format.
        pub fn spec(&self) -> QuantSpec {
            self.spec
        }

        /// Number of elements.
        pub fn len(&self) -> usize {
            self.len
        }

        /// Whether there are no elements.
        pub fn is_empty(&self) -> bool {
            self.len == 0
        }

        /// Number of groups.
        pub fn num_groups(&self) -> usize {
            self.spec.num_groups(self.len)
        }
    };
}
#[cfg_attr(not(feature = "cuda"), allow(unused_imports))]
pub(crate) use shape_accessors;

impl<'a> QuantizedRef<'a> {
    /// Parses and validates a wire encoding without copying it.
    ///
    /// Errors (never panics) on truncated or oversized buffers, bad magic,
    /// unknown versions, a wrong header checksum, inconsistent fields,
    /// non-finite or non-positive scales, non-finite offsets and a nonzero
    /// INT4 padding nibble. See [`crate::wire`] for the layout.
    ///
    /// ```
    /// use zeropp_quant::{dequantize, quantize, Options, QuantSpec, QuantizedRef};
    /// let x = [0.5f32, -1.0, 0.25, 2.0];
    /// let wire = quantize(&x, QuantSpec::int8(2)?, &Options::default())?.to_bytes();
    /// let view = QuantizedRef::from_bytes(&wire)?; // borrows `wire`
    /// let y = dequantize(&view, &Options::default())?;
    /// assert_eq!(y.len(), 4);
    /// # Ok::<(), zeropp_quant::QuantError>(())
    /// ```
    pub fn from_bytes(buf: &'a [u8]) -> Result<Self> {
        let h = wire::read_header(buf)?;
        let groups = h.spec.num_groups(h.len);
        // `read_header` checked that the buffer is exactly header + payload.
        let body = &buf[wire::HEADER_LEN..];
        let (scales, rest) = body.split_at(4 * groups);
        let (offsets, data) = if h.spec.scheme().has_offsets() {
            let (o, d) = rest.split_at(4 * groups);
            (Some(Params::Le(o)), d)
        } else {
            (None, rest)
        };
        let scales = Params::Le(scales);
        validate(&h.spec, h.len, data, scales, offsets)?;
        Ok(Self { spec: h.spec, len: h.len, data, scales, offsets })
    }

    shape_accessors!();

    /// The packed integer data.
    pub fn data(&self) -> &'a [u8] {
        self.data
    }

    /// The stored scale (`1/s`) of group `g`, or `None` if out of range.
    pub fn scale(&self, g: usize) -> Option<f32> {
        (g < self.num_groups()).then(|| self.scales.get(g))
    }

    /// The stored offset of group `g` (0.0 for the symmetric scheme), or
    /// `None` if out of range.
    pub fn offset(&self, g: usize) -> Option<f32> {
        (g < self.num_groups()).then(|| self.offset_unchecked(g))
    }

    #[inline]
    pub(crate) fn scale_unchecked(&self, g: usize) -> f32 {
        self.scales.get(g)
    }

    #[inline]
    pub(crate) fn offset_unchecked(&self, g: usize) -> f32 {
        self.offsets.as_ref().map_or(0.0, |o| o.get(g))
    }

    /// Size of the wire encoding.
    pub fn encoded_len(&self) -> usize {
        wire::encoded_len(self.spec, self.len)
    }

    /// Writes the wire encoding into `buf[..self.encoded_len()]` and returns
    /// the number of bytes written.
    pub fn write_into(&self, buf: &mut [u8]) -> Result<usize> {
        let total = self.encoded_len();
        if buf.len() < total {
            return Err(QuantError::BufferTooSmall {
                what: "wire encoding",
                needed: total,
                actual: buf.len(),
            });
        }
        wire::write_header(buf, &self.spec, self.len)?;
        let groups = self.num_groups();
        let mut at = wire::HEADER_LEN;
        for g in 0..groups {
            buf[at..at + 4].copy_from_slice(&self.scales.get(g).to_le_bytes());
            at += 4;
        }
        if let Some(o) = &self.offsets {
            for g in 0..groups {
                buf[at..at + 4].copy_from_slice(&o.get(g).to_le_bytes());
                at += 4;
            }
        }
        buf[at..at + self.data.len()].copy_from_slice(self.data);
        Ok(at + self.data.len())
    }

    /// The wire encoding as a new vector.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.encoded_len()];
        // The buffer has exactly the required size, so this cannot fail.
        let _ = self.write_into(&mut v);
        v
    }

    /// Copies into an owned [`Quantized`].
    pub fn to_owned(&self) -> Quantized {
        let groups = self.num_groups();
        Quantized {
            spec: self.spec,
            len: self.len,
            data: self.data.to_vec(),
            scales: (0..groups).map(|g| self.scales.get(g)).collect(),
            offsets: match &self.offsets {
                Some(o) => (0..groups).map(|g| o.get(g)).collect(),
                None => Vec::new(),
            },
        }
    }
}

impl Quantized {
    /// Builds a value from its parts, validating them like a decoder would.
    /// `offsets` must be `Some` (one per group) exactly for the asymmetric
    /// scheme.
    pub fn from_parts(
        spec: QuantSpec,
        len: usize,
        data: Vec<u8>,
        scales: Vec<f32>,
        offsets: Option<Vec<f32>>,
    ) -> Result<Self> {
        validate(&spec, len, &data, Params::F32(&scales), offsets.as_deref().map(Params::F32))?;
        Ok(Self { spec, len, data, scales, offsets: offsets.unwrap_or_default() })
    }

    /// A value of `len` zero elements (scales 1, offsets 0), to be used as
    /// a reusable destination of [`crate::quantize_into`] and
    /// [`crate::dequant_reduce_quant_into`].
    pub fn zeroed(spec: QuantSpec, len: usize) -> Result<Self> {
        if wire::checked_encoded_len(&spec, len).is_none() {
            return Err(QuantError::TooLarge(len as u64));
        }
        let groups = spec.num_groups(len);
        Ok(Self {
            spec,
            len,
            data: vec![0; spec.data_len(len)],
            scales: vec![1.0; groups],
            offsets: if spec.scheme().has_offsets() { vec![0.0; groups] } else { Vec::new() },
        })
    }

    /// Decodes (and copies) a wire encoding; see [`QuantizedRef::from_bytes`].
    pub fn from_bytes(buf: &[u8]) -> Result<Self> {
        Ok(QuantizedRef::from_bytes(buf)?.to_owned())
    }

    /// The borrowed view.
    pub fn view(&self) -> QuantizedRef<'_> {
        QuantizedRef {
            spec: self.spec,
            len: self.len,
            data: &self.data,
            scales: Params::F32(&self.scales),
            offsets: self.spec.scheme().has_offsets().then_some(Params::F32(&self.offsets)),
        }
    }

    shape_accessors!();

    /// The packed integer data.
    pub fn data(&self) -> &[u8] {
        &self.data
    }

    /// Stored scales (`1/s`), one per group.
    pub fn scales(&self) -> &[f32] {
        &self.scales
    }

    /// Stored offsets, one per group (asymmetric scheme), else `None`.
    pub fn offsets(&self) -> Option<&[f32]> {
        self.spec.scheme().has_offsets().then_some(&self.offsets[..])
    }

    /// The quantized integer of element `i` (unpacked, sign-extended), or
    /// `None` if out of range.
    pub fn q(&self, i: usize) -> Option<i8> {
        (i < self.len).then(|| wire::q_at(self.spec.bits(), &self.data, i))
    }

    /// Size of the wire encoding.
    pub fn encoded_len(&self) -> usize {
        wire::encoded_len(self.spec, self.len)
    }

    /// The wire encoding as a new vector.
    pub fn to_bytes(&self) -> Vec<u8> {
        self.view().to_bytes()
    }

    /// Writes the wire encoding into `buf` (at least [`Self::encoded_len`]
    /// bytes) and returns the number of bytes written.
    pub fn write_into(&self, buf: &mut [u8]) -> Result<usize> {
        self.view().write_into(buf)
    }

    /// The mutable destination for the quantizing kernels.
    pub(crate) fn out(&mut self) -> QOut<'_> {
        let has = self.spec.scheme().has_offsets();
        QOut {
            data: &mut self.data,
            scales: ParamsMut::F32(&mut self.scales),
            offsets: if has { Some(ParamsMut::F32(&mut self.offsets)) } else { None },
        }
    }
}
