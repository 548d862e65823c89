//! Wire encoding: round trips, validation errors and fuzzed decoding.

use crate::common::*;
use proptest::prelude::*;
use zeropp_quant::wire::{HEADER_LEN, VERSION};
use zeropp_quant::{
    Bits, DecodeError, Options, QuantError, QuantSpec, Quantized, QuantizedRef, Scheme, dequant_reduce_quant,
    dequantize, dequantize_add, encoded_len, quantize,
};

fn sample(scheme: Scheme, bits: Bits, len: usize, gs: usize) -> Quantized {
    let x: Vec<f32> = (0..len).map(|i| ((i * 31 % 17) as f32 - 8.0) * 0.3).collect();
    quantize(&x, QuantSpec::new(bits, scheme, gs).unwrap(), &Options::default()).unwrap()
}

fn decode_err(buf: &[u8]) -> DecodeError {
    match QuantizedRef::from_bytes(buf) {
        Err(QuantError::Decode(e)) => e,
        other => panic!("expected a decode error, got {other:?}"),
    }
}

/// Rewrites the header checksum after a deliberate header edit.
fn fix_crc(buf: &mut [u8]) {
    let mut crc = !0u32;
    for &b in &buf[..28] {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = (crc >> 1) ^ (0x82F6_3B78 & (crc & 1).wrapping_neg());
        }
    }
    buf[28..32].copy_from_slice(&(!crc).to_le_bytes());
}

#[test]
fn layout_and_lengths() {
    for (scheme, bits, len, gs) in [
        (Scheme::Symmetric, Bits::Int8, 10, 4),
        (Scheme::Asymmetric, Bits::Int4, 11, 3),
        (Scheme::Symmetric, Bits::Int4, 0, 5),
    ] {
        let q = sample(scheme, bits, len, gs);
        let b = q.to_bytes();
        let groups = len.div_ceil(gs);
        let per = if scheme == Scheme::Asymmetric { 8 } else { 4 };
        let data = if bits == Bits::Int4 { len.div_ceil(2) } else { len };
        assert_eq!(b.len(), HEADER_LEN + per * groups + data);
        assert_eq!(b.len(), encoded_len(q.spec(), len));
        assert_eq!(&b[0..4], b"ZPPQ");
        assert_eq!(u16::from_le_bytes([b[4], b[5]]), VERSION);
        assert_eq!(&b[b.len() - data..], q.data());
        if let Some(&s0) = q.scales().first() {
            assert_eq!(f32::from_le_bytes(b[32..36].try_into().unwrap()), s0);
        }
        // write_into a larger buffer writes exactly encoded_len bytes.
        let mut big = vec![7u8; b.len() + 9];
        assert_eq!(q.write_into(&mut big).unwrap(), b.len());
        assert_eq!(&big[..b.len()], &b[..]);
        assert!(big[b.len()..].iter().all(|&v| v == 7));
        // Too small a buffer is an error.
        let mut small = vec![0u8; b.len() - 1];
        assert!(matches!(q.write_into(&mut small), Err(QuantError::BufferTooSmall { .. })));
    }
}

#[test]
fn clear_errors() {
    let q = sample(Scheme::Asymmetric, Bits::Int4, 11, 3);
    let good = q.to_bytes();
    assert!(matches!(decode_err(&good[..10]), DecodeError::TruncatedHeader(10)));
    assert!(matches!(decode_err(&good[..good.len() - 1]), DecodeError::LengthMismatch { .. }));
    let mut longer = good.clone();
    longer.push(0);
    assert!(matches!(decode_err(&longer), DecodeError::LengthMismatch { .. }));
    let mut m = good.clone();
    m[0] = b'X';
    assert!(matches!(decode_err(&m), DecodeError::BadMagic(_)));
    let mut m = good.clone();
    m[4] = 2;
    assert!(matches!(decode_err(&m), DecodeError::UnsupportedVersion(2)));
    let mut m = good.clone();
    m[13] ^= 1;
    assert!(matches!(decode_err(&m), DecodeError::HeaderChecksum { .. }));
    let mut m = good.clone();
    m[6] = 2;
    fix_crc(&mut m);
    assert!(matches!(decode_err(&m), DecodeError::BadField { field: "bits", .. }));
    let mut m = good.clone();
    m[7] = 9;
    fix_crc(&mut m);
    assert!(matches!(decode_err(&m), DecodeError::BadField { field: "scheme", .. }));
    let mut m = good.clone();
    m[8..12].copy_from_slice(&0u32.to_le_bytes());
    fix_crc(&mut m);
    assert!(matches!(decode_err(&m), DecodeError::BadField { field: "group_size", .. }));
    let mut m = good.clone();
    m[12..20].copy_from_slice(&20u64.to_le_bytes());
    fix_crc(&mut m);
    assert!(matches!(decode_err(&m), DecodeError::BadField { field: "payload_len", .. }));
    let mut m = good.clone();
    m[12..20].copy_from_slice(&u64::MAX.to_le_bytes());
    fix_crc(&mut m);
    assert!(matches!(decode_err(&m), DecodeError::BadField { .. }));
    let mut m = good.clone();
    m[32..36].copy_from_slice(&f32::NAN.to_le_bytes());
    assert!(matches!(decode_err(&m), DecodeError::BadScale { group: 0, .. }));
    let mut m = good.clone();
    m[36..40].copy_from_slice(&(-1.0f32).to_le_bytes());
    assert!(matches!(decode_err(&m), DecodeError::BadScale { group: 1, .. }));
    let mut m = good.clone();
    m[48..52].copy_from_slice(&f32::INFINITY.to_le_bytes());
    assert!(matches!(decode_err(&m), DecodeError::BadOffset { group: 0, .. }));
    let mut m = good.clone();
    *m.last_mut().unwrap() |= 1; // padding nibble (len 11 is odd)
    assert!(matches!(decode_err(&m), DecodeError::BadPadding));
    // Messages are one readable line.
    let msg = QuantizedRef::from_bytes(&good[..3]).unwrap_err().to_string();
    assert!(msg.contains("truncated") && !msg.contains('\n'), "{msg}");
}

#[test]
fn from_parts_validates() {
    let spec = QuantSpec::int8(4).unwrap();
    assert!(Quantized::from_parts(spec, 5, vec![0; 5], vec![1.0, 1.0], None).is_ok());
    assert!(Quantized::from_parts(spec, 5, vec![0; 4], vec![1.0, 1.0], None).is_err());
    assert!(Quantized::from_parts(spec, 5, vec![0; 5], vec![1.0], None).is_err());
    assert!(Quantized::from_parts(spec, 5, vec![0; 5], vec![1.0, 0.0], None).is_err());
    assert!(Quantized::from_parts(spec, 5, vec![0; 5], vec![1.0, 1.0], Some(vec![0.0; 2])).is_err());
}

proptest! {
    #![proptest_config(config(256))]

    #[test]
    fn round_trip(x in vector(), gs in group_size(), bits in prop_oneof![Just(Bits::Int4), Just(Bits::Int8)], asym: bool) {
        let scheme = if asym { Scheme::Asymmetric } else { Scheme::Symmetric };
        let q = quantize(&x, QuantSpec::new(bits, scheme, gs).unwrap(), &Options::default()).unwrap();
        let b = q.to_bytes();
        prop_assert_eq!(b.len(), encoded_len(q.spec(), x.len()));
        let owned = Quantized::from_bytes(&b).unwrap();
        prop_assert_eq!(&owned, &q);
        let view = QuantizedRef::from_bytes(&b).unwrap();
        prop_assert_eq!(view.to_bytes(), b.clone());
        prop_assert_eq!(view.data(), q.data());
        // Dequantizing the zero-copy view equals dequantizing the owned value.
        let a: Vec<u32> = dequantize(&view, &Options::default()).unwrap().iter().map(|v| v.to_bits()).collect();
        let c: Vec<u32> = dequantize(&q, &Options::default()).unwrap().iter().map(|v| v.to_bits()).collect();
        prop_assert_eq!(a, c);
    }

    /// Random bytes never panic (and almost never decode).
    #[test]
    fn fuzz_random_bytes(b in proptest::collection::vec(any::<u8>(), 0..200)) {
        let _ = QuantizedRef::from_bytes(&b);
        let _ = Quantized::from_bytes(&b);
    }

    /// Random bytes behind a valid-looking header never panic.
    #[test]
    fn fuzz_random_header_fields(gs in 0u32..10, len in 0u64..40, bits in 0u8..10, scheme in 0u8..3,
                                 body in proptest::collection::vec(any::<u8>(), 0..400)) {
        let mut b = vec![0u8; 32];
        b[0..4].copy_from_slice(b"ZPPQ");
        b[4..6].copy_from_slice(&1u16.to_le_bytes());
        b[6] = bits;
        b[7] = scheme;
        b[8..12].copy_from_slice(&gs.to_le_bytes());
        b[12..20].copy_from_slice(&len.to_le_bytes());
        b[20..28].copy_from_slice(&(body.len() as u64).to_le_bytes());
        fix_crc(&mut b);
        b.extend_from_slice(&body);
        if let Ok(v) = QuantizedRef::from_bytes(&b) {
            let y = dequantize(&v, &Options::default()).unwrap();
            prop_assert!(y.iter().all(|v| v.is_finite()));
        }
    }

    /// Mutated valid encodings (bit flips, truncation, extension) never
    /// panic; whatever still decodes is usable by every operation.
    #[test]
    fn fuzz_mutated(x in vector(), gs in 1usize..50, flips in proptest::collection::vec((any::<usize>(), 0u8..8), 0..4),
                    cut in any::<usize>(), extra in 0usize..3, asym: bool, fix: bool) {
        let scheme = if asym { Scheme::Asymmetric } else { Scheme::Symmetric };
        let q = quantize(&x, QuantSpec::new(Bits::Int4, scheme, gs).unwrap(), &Options::default()).unwrap();
        let mut b = q.to_bytes();
        for (pos, bit) in flips {
            let p = pos % b.len();
            b[p] ^= 1 << bit;
        }
        if fix {
            fix_crc(&mut b);
        }
        if cut % 3 == 0 {
            b.truncate(cut % (b.len() + 1));
        }
        b.extend(std::iter::repeat_n(0u8, extra));
        if let Ok(v) = QuantizedRef::from_bytes(&b) {
            let y = dequantize(&v, &Options::default()).unwrap();
            prop_assert_eq!(y.len(), v.len());
            let mut acc = vec![0f32; v.len()];
            dequantize_add(&v, &mut acc, &Options::default()).unwrap();
            let _ = dequant_reduce_quant(&[v, v], QuantSpec::int8(3).unwrap(), &Options::default());
            prop_assert_eq!(Quantized::from_bytes(&b).unwrap().to_bytes(), b);
        }
    }
}
