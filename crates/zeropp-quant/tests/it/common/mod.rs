//! An independent, deliberately naive reference implementation of the
//! formats (written from the spec, sharing no code with the crate), plus
//! proptest strategies.

#![allow(dead_code, unreachable_pub)]

use proptest::prelude::*;

/// Reference quantization: per-element integers (unpacked), scales, offsets.
pub struct RefQ {
    pub q: Vec<i8>,
    pub scales: Vec<f32>,
    pub offsets: Vec<f32>,
}

/// Nearest-even reference quantizer following the spec literally, in f32.
pub fn ref_quantize(x: &[f32], bits: u32, asym: bool, gs: usize) -> RefQ {
    let qmin = -(1i32 << (bits - 1));
    let qmax = (1i32 << (bits - 1)) - 1;
    let mut out = RefQ { q: Vec::new(), scales: Vec::new(), offsets: Vec::new() };
    for grp in x.chunks(gs) {
        let (s, off) = if asym {
            let mn = grp.iter().copied().fold(f32::INFINITY, f32::min);
            let mx = grp.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let s = if mx == mn { 1.0 } else { 2f32.powi(bits as i32) / (mx - mn) };
            (s, (mx + mn) / 2.0)
        } else {
            let amax = grp.iter().map(|v| v.abs()).fold(0.0f32, f32::max);
            let s = if amax == 0.0 { 1.0 } else { 2f32.powi(bits as i32 - 1) / amax };
            (s, 0.0)
        };
        out.scales.push(1.0 / s);
        if asym {
            out.offsets.push(off);
        }
        for &v in grp {
            let r = ((v - off) * s).round_ties_even() as i32;
            out.q.push(r.clamp(qmin, qmax) as i8);
        }
    }
    out
}

/// Reference INT4 packing: even element in the high nibble.
pub fn ref_pack4(q: &[i8]) -> Vec<u8> {
    q.chunks(2)
        .map(|p| {
            let hi = (p[0] as u8 & 0xF) << 4;
            let lo = p.get(1).map_or(0, |&v| v as u8 & 0xF);
            hi | lo
        })
        .collect()
}

/// Reference packing for either width.
pub fn ref_pack(q: &[i8], bits: u32) -> Vec<u8> {
    if bits == 4 { ref_pack4(q) } else { q.iter().map(|&v| v as u8).collect() }
}

/// Reference dequantization.
pub fn ref_dequant(r: &RefQ, gs: usize) -> Vec<f32> {
    r.q.iter()
        .enumerate()
        .map(|(i, &q)| {
            let g = i / gs;
            let off = r.offsets.get(g).copied().unwrap_or(0.0);
            f32::from(q) * r.scales[g] + off
        })
        .collect()
}

/// Group sizes: small, primes, powers of two, and random.
pub fn group_size() -> impl Strategy<Value = usize> {
    prop_oneof![
        Just(1usize),
        Just(2),
        Just(3),
        Just(7),
        Just(31),
        Just(64),
        Just(127),
        Just(256),
        Just(2048),
        1usize..600,
    ]
}

/// Vector lengths including 0, 1 and primes.
pub fn length() -> impl Strategy<Value = usize> {
    prop_oneof![Just(0usize), Just(1), Just(2), Just(3), Just(13), Just(97), Just(1021), 0usize..3000,]
}

/// Finite values of a random magnitude (2^-20 .. 2^20), with some exact
/// zeros, repeats and negative zeros.
pub fn values(len: usize) -> impl Strategy<Value = Vec<f32>> {
    (-20i32..20, any::<u64>()).prop_map(move |(e, seed)| {
        let mag = 2f32.powi(e);
        let mut st = seed;
        (0..len)
            .map(|_| {
                st = st.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                let r = (st >> 40) as u32;
                match r % 23 {
                    0 => 0.0,
                    1 => -0.0,
                    2 => mag,
                    _ => ((r as f32 / 16_777_216.0) * 2.0 - 1.0) * mag * 1.7,
                }
            })
            .collect()
    })
}

/// A (len, values) pair.
pub fn vector() -> impl Strategy<Value = Vec<f32>> {
    length().prop_flat_map(values)
}

/// The proptest configuration of every property block: `cases` cases, and
/// failures persisted next to the test's own source file
/// (`properties.rs` -> `properties.proptest-regressions`). Proptest's default
/// would look for a `proptest-regressions/` folder beside `tests/it/`,
/// because `tests/it/main.rs` makes it treat `tests/it` as a crate root.
pub fn config(cases: u32) -> ProptestConfig {
    ProptestConfig {
        failure_persistence: Some(Box::new(proptest::test_runner::FileFailurePersistence::WithSource(
            "proptest-regressions",
        ))),
        ..ProptestConfig::with_cases(cases)
    }
}
