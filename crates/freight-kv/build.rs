//! Generates the gRPC control plane's code from proto/kv.proto (needs protoc).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/kv.proto");
    tonic_prost_build::configure().compile_protos(&["proto/kv.proto"], &["proto"])?;
    Ok(())
}
