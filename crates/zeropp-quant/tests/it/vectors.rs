//! Fixed vectors from our own Python emulation of DeepSpeed's quantization
//! formula (`tests/data/gen_vectors.py`, output in `tests/data/vectors.json`;
//! not produced by or compared with DeepSpeed itself, see
//! `tests/data/README.md`): bytes, scales, offsets, dequantized values and
//! the wire encoding, checked for every available kernel.

use serde_json::Value;
use zeropp_quant::{
    Bits, Options, QuantSpec, Quantized, QuantizedRef, Rounding, Scheme, available_kernels, dequantize,
    quantize, quantize_to_wire,
};

fn hex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
}

fn u32s(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

#[test]
fn python_reference_vectors() {
    let text = include_str!("../data/vectors.json");
    let root: Value = serde_json::from_str(text).unwrap();
    let cases = root["cases"].as_array().unwrap();
    assert!(cases.len() >= 8);
    for c in cases {
        let name = c["name"].as_str().unwrap();
        let bits = Bits::from_bits(c["bits"].as_u64().unwrap() as u32).unwrap();
        let scheme: Scheme = c["scheme"].as_str().unwrap().parse().unwrap();
        let gs = c["group_size"].as_u64().unwrap() as usize;
        let spec = QuantSpec::new(bits, scheme, gs).unwrap();
        let x: Vec<f32> = u32s(&c["input_bits"]).into_iter().map(f32::from_bits).collect();
        let rounding = match c["seed"].as_u64() {
            Some(seed) => Rounding::Stochastic { seed },
            None => Rounding::NearestEven,
        };
        let wire = hex(c["wire_hex"].as_str().unwrap());
        for k in available_kernels() {
            let o = Options::default().with_rounding(rounding).with_kernel(k);
            let q = quantize(&x, spec, &o).unwrap();
            assert_eq!(q.data(), &hex(c["data_hex"].as_str().unwrap())[..], "{name} {k}: data");
            let q_ints: Vec<i64> = c["q"].as_array().unwrap().iter().map(|v| v.as_i64().unwrap()).collect();
            for (i, &v) in q_ints.iter().enumerate() {
                assert_eq!(i64::from(q.q(i).unwrap()), v, "{name} {k}: q[{i}]");
            }
            let scales: Vec<u32> = q.scales().iter().map(|v| v.to_bits()).collect();
            assert_eq!(scales, u32s(&c["scale_bits"]), "{name} {k}: scales");
            let offs: Vec<u32> = q.offsets().unwrap_or(&[]).iter().map(|v| v.to_bits()).collect();
            assert_eq!(offs, u32s(&c["offset_bits"]), "{name} {k}: offsets");
            let y: Vec<u32> = dequantize(&q, &o).unwrap().iter().map(|v| v.to_bits()).collect();
            assert_eq!(y, u32s(&c["dequant_bits"]), "{name} {k}: dequantized");
            assert_eq!(q.to_bytes(), wire, "{name} {k}: wire");
            let mut buf = vec![0xAA; wire.len()];
            assert_eq!(quantize_to_wire(&x, spec, &o, &mut buf).unwrap(), wire.len());
            assert_eq!(buf, wire, "{name} {k}: quantize_to_wire");
        }
        assert_eq!(Quantized::from_bytes(&wire).unwrap().to_bytes(), wire, "{name}");
        assert_eq!(QuantizedRef::from_bytes(&wire).unwrap().len(), x.len(), "{name}");
    }
}
