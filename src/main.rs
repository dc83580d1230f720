//! The `ironic-image-worker` binary; everything lives in the library.

fn main() -> std::process::ExitCode {
    ironic_image_worker::cli::main()
}
