//! The versioned wire encoding of a quantized vector.
//!
//! # Layout (version 1)
//!
//! All integers and floats are little-endian. `G = ceil(len / group_size)`
//! is the number of groups; `D = len` bytes for INT8 and `ceil(len / 2)`
//! bytes for INT4.
//!
//! | bytes | field | notes |
//! |---|---|---|
//! | 0..4 | magic | ASCII `ZPPQ` |
//! | 4..6 | version | `u16`, currently 1 |
//! | 6 | bits | `u8`: 4 or 8 |
//! | 7 | scheme | `u8`: 0 = symmetric, 1 = asymmetric |
//! | 8..12 | group_size | `u32`, at least 1 |
//! | 12..20 | len | `u64`, number of elements |
//! | 20..28 | payload_len | `u64`, bytes after the header: `4G` (+ `4G` if asymmetric) `+ D` |
//! | 28..32 | header_crc | `u32`, CRC-32C (Castagnoli) of bytes 0..28 |
//! | 32..32+4G | scales | `f32` per group: the stored scale `1/s` (finite, > 0), or [`POISON_BITS`] |
//! | next 4G | offsets | `f32` per group, asymmetric only (finite; [`POISON_BITS`] in a poisoned group) |
//! | next D | data | quantized integers, two's complement |
//!
//! INT4 data packs element `2k` in the high nibble and `2k+1` in the low
//! nibble of byte `k`: `byte_k = (q_2k & 0xF) << 4 | (q_2k+1 & 0xF)`. For an
//! odd `len`, the low nibble of the last byte is padding and must be 0.
//! Packing runs over the whole vector, so with an odd group size a byte can
//! hold elements of two groups.
//!
//! Decoding ([`crate::QuantizedRef::from_bytes`]) checks the magic, the
//! version, the checksum, every field's range, `payload_len` against the
//! value computed from the other fields, the buffer length against the total
//! (truncated and oversized buffers are both errors), every scale and offset,
//! and the padding nibble. The payload itself is not checksummed (that would
//! cost a pass over the data on the hot path); any payload bytes decode to
//! finite values, except in a poisoned group.
//!
//! A **poisoned group** is how a non-finite input travels when the quantizer
//! was asked to propagate it ([`crate::NonFinite::Propagate`]): its scale (and
//! offset) is exactly the canonical quiet NaN, [`POISON_BITS`], and its integers
//! are 0, so every element decodes to NaN. Any other non-finite or non-positive
//! scale is still a decoding error, and so is half a poisoned asymmetric group
//! (a poisoned scale beside a finite offset, or the other way round).

use crate::error::{DecodeError, QuantError, Result};

/// The bits of a poisoned group's stored scale (and offset): the canonical
/// quiet NaN of `f32` (see the module docs).
pub const POISON_BITS: u32 = 0x7FC0_0000;
use crate::spec::{Bits, QuantSpec, Scheme};

pub use crate::wire_header::{HEADER_LEN, MAGIC, VERSION};

/// The quantized integer of element `i` (in range) of packed `data`
/// (INT4: the even element in the high nibble).
#[inline]
pub(crate) fn q_at(bits: Bits, data: &[u8], i: usize) -> i8 {
    match bits {
        Bits::Int4 => {
            let b = data[i / 2];
            if i & 1 == 0 { (b as i8) >> 4 } else { ((b << 4) as i8) >> 4 }
        }
        Bits::Int8 => data[i] as i8,
    }
}

/// Payload bytes (everything after the header) for `len` elements, if it
/// fits in a `u64`.
pub(crate) fn payload_len_u64(spec: &QuantSpec, len: u64) -> Option<u64> {
    let groups = len.div_ceil(spec.group_size() as u64);
    let per_group = if spec.scheme().has_offsets() { 8 } else { 4 };
    let data = match spec.bits() {
        Bits::Int4 => len.div_ceil(2),
        Bits::Int8 => len,
    };
    groups.checked_mul(per_group)?.checked_add(data)
}

/// Total encoded bytes for `len` elements, if representable as `usize`.
pub(crate) fn checked_encoded_len(spec: &QuantSpec, len: usize) -> Option<usize> {
    let p = payload_len_u64(spec, u64::try_from(len).ok()?)?;
    usize::try_from(p).ok()?.checked_add(HEADER_LEN)
}

/// Size in bytes of the wire encoding of `len` elements under `spec`,
/// computable without the data. Saturates at `usize::MAX` for lengths whose
/// encoding could not exist in memory.
pub fn encoded_len(spec: QuantSpec, len: usize) -> usize {
    checked_encoded_len(&spec, len).unwrap_or(usize::MAX)
}

/// The 32-byte header of the wire encoding of `len` elements under `spec`:
/// what [`crate::quantize_to_wire`] writes before the scales. Callers that
/// produce the payload elsewhere (zeropp.torch's torch-op kernels, on a GPU)
/// prepend it, so their encodings are byte-for-byte the Rust kernels'.
///
/// ```
/// use zeropp_quant::{Options, QuantSpec, encoded_len, quantize_to_wire, wire};
/// let spec = QuantSpec::int4(64)?;
/// let x = [0.5f32; 100];
/// let mut buf = vec![0u8; encoded_len(spec, x.len())];
/// quantize_to_wire(&x[..], spec, &Options::default(), &mut buf)?;
/// assert_eq!(wire::header(&spec, x.len())?[..], buf[..wire::HEADER_LEN]);
/// # Ok::<(), zeropp_quant::QuantError>(())
/// ```
pub fn header(spec: &QuantSpec, len: usize) -> Result<[u8; HEADER_LEN]> {
    let mut h = [0u8; HEADER_LEN];
    write_header(&mut h, spec, len)?;
    Ok(h)
}

fn scheme_code(s: Scheme) -> u8 {
    match s {
        Scheme::Symmetric => 0,
        Scheme::Asymmetric => 1,
    }
}

/// Writes the 32-byte header for `(spec, len)` into `buf[..32]`.
pub(crate) fn write_header(buf: &mut [u8], spec: &QuantSpec, len: usize) -> Result<()> {
    let payload = u64::try_from(len)
        .ok()
        .and_then(|l| payload_len_u64(spec, l))
        .ok_or(QuantError::TooLarge(len as u64))?;
    let actual = buf.len();
    let h = buf.get_mut(..HEADER_LEN).ok_or(QuantError::BufferTooSmall {
        what: "wire header",
        needed: HEADER_LEN,
        actual,
    })?;
    h[0..4].copy_from_slice(&MAGIC);
    h[4..6].copy_from_slice(&VERSION.to_le_bytes());
    h[6] = spec.bits().bits() as u8;
    h[7] = scheme_code(spec.scheme());
    let gs =
        u32::try_from(spec.group_size()).map_err(|_| QuantError::GroupSizeTooLarge(spec.group_size()))?;
    h[8..12].copy_from_slice(&gs.to_le_bytes());
    h[12..20].copy_from_slice(&(len as u64).to_le_bytes());
    h[20..28].copy_from_slice(&payload.to_le_bytes());
    // CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), from the `crc32c` crate.
    let crc = crc32c::crc32c(&h[..28]);
    h[28..32].copy_from_slice(&crc.to_le_bytes());
    Ok(())
}

fn le_u16(b: &[u8], at: usize) -> u16 {
    let mut a = [0u8; 2];
    a.copy_from_slice(&b[at..at + 2]);
    u16::from_le_bytes(a)
}

fn le_u32(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(a)
}

fn le_u64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

/// A parsed and checked header.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Header {
    pub(crate) spec: QuantSpec,
    pub(crate) len: usize,
}

/// Parses and checks the header, including the total length of `buf`.
pub(crate) fn read_header(buf: &[u8]) -> Result<Header, DecodeError> {
    if buf.len() < HEADER_LEN {
        return Err(DecodeError::TruncatedHeader(buf.len()));
    }
    let mut magic = [0u8; 4];
    magic.copy_from_slice(&buf[0..4]);
    if magic != MAGIC {
        return Err(DecodeError::BadMagic(magic));
    }
    let version = le_u16(buf, 4);
    if version != VERSION {
        return Err(DecodeError::UnsupportedVersion(version));
    }
    let stored = le_u32(buf, 28);
    let computed = crc32c::crc32c(&buf[..28]);
    if stored != computed {
        return Err(DecodeError::HeaderChecksum { stored, computed });
    }
    let bits = match buf[6] {
        4 => Bits::Int4,
        8 => Bits::Int8,
        v => {
            return Err(DecodeError::BadField { field: "bits", value: u64::from(v) });
        }
    };
    let scheme = match buf[7] {
        0 => Scheme::Symmetric,
        1 => Scheme::Asymmetric,
        v => {
            return Err(DecodeError::BadField { field: "scheme", value: u64::from(v) });
        }
    };
    let gs = le_u32(buf, 8);
    let spec = QuantSpec::new(bits, scheme, gs as usize)
        .map_err(|_| DecodeError::BadField { field: "group_size", value: u64::from(gs) })?;
    let len64 = le_u64(buf, 12);
    let payload = le_u64(buf, 20);
    let expected =
        payload_len_u64(&spec, len64).ok_or(DecodeError::BadField { field: "len", value: len64 })?;
    if payload != expected {
        return Err(DecodeError::BadField { field: "payload_len", value: payload });
    }
    let total = expected.checked_add(HEADER_LEN as u64);
    if total != Some(buf.len() as u64) {
        return Err(DecodeError::LengthMismatch { expected: total.unwrap_or(u64::MAX), actual: buf.len() });
    }
    // The whole encoding is in memory, so `len` fits in `usize`.
    let len = usize::try_from(len64).map_err(|_| DecodeError::BadField { field: "len", value: len64 })?;
    Ok(Header { spec, len })
}

#[cfg(test)]
mod tests {
    /// The checksum is the standard CRC-32C: its published check value, and
    /// the bitwise definition the header used before it came from the crate.
    #[test]
    fn header_crc_is_standard_crc32c() {
        assert_eq!(crc32c::crc32c(b"123456789"), 0xE306_9283);
        let bitwise = |bytes: &[u8]| {
            let mut crc = !0u32;
            for &b in bytes {
                crc ^= u32::from(b);
                for _ in 0..8 {
                    crc = (crc >> 1) ^ (0x82F6_3B78 & (crc & 1).wrapping_neg());
                }
            }
            !crc
        };
        let bytes: Vec<u8> = (0..=255u8).cycle().take(28 * 10).collect();
        for chunk in bytes.chunks(28) {
            assert_eq!(crc32c::crc32c(chunk), bitwise(chunk));
        }
    }
}
