//! Fuzzes the qcow2 header validator: whatever the bytes, it must answer
//! (Ok or a clear error) without panicking, and an accepted header must be
//! self-consistent. Run: `cargo +nightly fuzz run qcow2_header` in `fuzz/`.
#![no_main]

use ironic_image_worker::image::qcow2;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let file_size = data.len() as u64 + (1 << 20);
    let limits = qcow2::Limits { max_virtual_size: 1 << 40 };
    if let Ok(h) = qcow2::parse(data, file_size, limits) {
        assert!((9..=21).contains(&h.cluster_bits));
        assert!(h.virtual_size <= limits.max_virtual_size);
        let _ = qcow2::check_l1_table(&h, data, file_size);
        let _ = qcow2::check_snapshot_table(&h, data, file_size);
    }
});
