#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| freight_fuzz::pipe(data));
