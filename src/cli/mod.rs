//! Command line: `serve` (the worker), one-shot `prepare` / `deployed` /
//! `cleanup` that run the pipeline without a broker and print the completion
//! event as JSON.
//!
//! # This folder
//!
//! Holds argument parsing, the one-shot commands (which call the pipeline
//! directly), `cache list/clean`, `inspect`, `send` (one command through
//! the broker, `send_rpc` through the JSON-RPC listener, and wait for its
//! completion) and `configuration`
//! (which files a command reads; `config check` and `config show`). Must
//! not know how the pipeline does its work.

pub(crate) mod configuration;
pub(crate) mod send;
mod send_rpc;

use crate::config::Config;
use crate::error::Result;
use crate::messages::Request;
use crate::messages::{Action, Completion, InstanceInfo, Options, Status};
use crate::metrics::Metrics;
use crate::node::NodeUuid;
use crate::pipeline::Pipeline;
use clap::{Args, Parser, Subcommand, ValueEnum};
use std::ffi::OsString;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

/// The command line: options every command shares, then the command.
#[derive(Debug, Parser)]
#[command(
    name = "ironic-image-worker",
    version,
    about = "Caches, converts, checksums and serves Ironic instance images for Ironic's \
             direct deploy, driven by RabbitMQ or, without a broker, by Ironic's JSON-RPC \
             client.",
    long_about = "Caches, converts, checksums and serves Ironic instance images for Ironic's \
                  direct deploy, driven by RabbitMQ or, without a broker (Metal3, Bifrost), \
                  by Ironic's JSON-RPC client.\n\nStart with `config check` and \
                  `config show` (the configuration in force and where each value came from), \
                  then `serve`. Every command reads the service's configuration: \
                  /etc/ironic-image-worker/worker.toml and /etc/ironic/ironic.conf when they \
                  exist, unless --config / --ironic-config name others ('' for none)."
)]
pub struct Cli {
    /// The worker's TOML configuration file (Ironic's section and option
    /// names); default /etc/ironic-image-worker/worker.toml when it
    /// exists; '' for none.
    #[arg(
        long,
        global = true,
        env = "IRONIC_IMAGE_WORKER_CONFIG",
        value_name = "FILE"
    )]
    pub config: Option<OsString>,
    /// The conductor's ironic.conf, to take the options shared with it
    /// from (host, transport_url, [deploy], [pxe], [agent], [conductor],
    /// [glance], notification topics); `--config`, the environment and
    /// `--set` override it. Default /etc/ironic/ironic.conf when it
    /// exists; '' for none.
    #[arg(
        long,
        global = true,
        env = "IRONIC_IMAGE_WORKER_IRONIC_CONFIG",
        value_name = "FILE"
    )]
    pub ironic_config: Option<OsString>,
    /// Override one option, e.g. `--set DEFAULT.host=cond-1` (repeatable).
    #[arg(long = "set", global = true, value_name = "SECTION.OPTION=VALUE")]
    pub set: Vec<String>,
    /// Log format on stderr (default `[log]format`).
    #[arg(long, global = true, value_enum)]
    pub log_format: Option<LogFormat>,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Log output formats.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines (also `text`).
    #[value(alias = "text")]
    Human,
    /// One JSON object per line.
    Json,
}

impl LogFormat {
    /// The flag's format, else `[log]format`'s.
    fn or_configured(flag: Option<LogFormat>, configured: crate::config::LogFormat) -> LogFormat {
        flag.unwrap_or(match configured {
            crate::config::LogFormat::Text => LogFormat::Human,
            crate::config::LogFormat::Json => LogFormat::Json,
        })
    }
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the worker: image server, metrics listener, and the broker
    /// consumer or (`[json_rpc]listen`) the JSON-RPC listener.
    Serve,
    /// Cache and publish an image for a node, without a broker.
    Prepare(PrepareArgs),
    /// Withdraw a deployed node's image URL and link, without a broker.
    Deployed(NodeArgs),
    /// Remove a node's image and URL, without a broker.
    Cleanup(NodeArgs),
    /// Send a command to a running worker: through the broker, or its
    /// JSON-RPC listener when `[amqp]enabled = false` (or `--transport
    /// json-rpc`).
    Send(send::SendArgs),
    /// Delete the queues of a conductor taken out of service (its command
    /// queue and dead-letter queue), which would otherwise stay bound to
    /// Ironic's notifications and to `all.image.warm` and grow for ever.
    /// Refused while a worker still consumes them.
    Retire {
        /// The retired conductor's host name (`[DEFAULT]host` of its worker).
        #[arg(long, visible_alias = "host")]
        conductor: String,
    },
    /// Look at or clean the master image cache.
    #[command(subcommand)]
    Cache(CacheCommand),
    /// Check the configuration (exit 1 with one line per problem) or show
    /// the values in force with their sources.
    #[command(subcommand)]
    Config(ConfigCommand),
    /// Detect an image file's format and virtual size and check its safety.
    Inspect {
        /// The image file.
        file: PathBuf,
    },
    /// Internal: convert a checked qcow2 to raw (run by the worker in a
    /// separate, memory-limited process).
    #[command(hide = true)]
    ConvertChild {
        /// Source qcow2.
        src: PathBuf,
        /// New raw file.
        dst: PathBuf,
        /// Also compute SHA-512.
        #[arg(long)]
        sha512: bool,
        /// Leave the MD5 out.
        #[arg(long)]
        no_md5: bool,
        /// The source is still being downloaded and will have this size.
        #[arg(long)]
        grow_to: Option<u64>,
    },
}

/// `config` subcommands.
#[derive(Debug, Subcommand)]
pub enum ConfigCommand {
    /// Read and check the configuration and the directories it names (as
    /// the user running it): exit 0 when valid, else exit 1 with one line
    /// per problem naming the option and where its value came from.
    Check,
    /// Print the configuration in force as TOML, each option with where
    /// its value came from (default, ironic.conf, OS_ variable, TOML file,
    /// IRONIC_IMAGE_WORKER__ variable, --set); secrets masked.
    Show,
}

/// `cache` subcommands.
#[derive(Debug, Subcommand)]
pub enum CacheCommand {
    /// List the masters: image, size, last used, linked nodes, converted.
    List {
        /// JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Apply the TTL and size limit now (never touching linked masters).
    Clean {
        /// Remove every master no node links, whatever the limits.
        #[arg(long)]
        all_unused: bool,
        /// Only say what would be removed.
        #[arg(long)]
        dry_run: bool,
    },
}

/// Arguments naming a node.
#[derive(Debug, Args)]
pub struct NodeArgs {
    /// Node UUID.
    #[arg(long)]
    pub node: String,
    /// Request id echoed in the completion event.
    #[arg(long)]
    pub request_id: Option<String>,
}

/// Ironic `instance_info` keys and per-request options of a prepare.
#[derive(Debug, Args)]
pub struct ImageArgs {
    /// `instance_info.image_source`.
    #[arg(long)]
    image_source: Option<String>,
    /// `instance_info.image_checksum` (hex, `algo:hex` or a checksum file URL).
    #[arg(long, visible_alias = "image-checksum")]
    checksum: Option<String>,
    /// `instance_info.image_os_hash_algo`.
    #[arg(long)]
    os_hash_algo: Option<String>,
    /// `instance_info.image_os_hash_value`.
    #[arg(long)]
    os_hash_value: Option<String>,
    /// `instance_info.image_disk_format`.
    #[arg(long)]
    disk_format: Option<String>,
    /// `instance_info.image_type` (`whole-disk` or `partition`).
    #[arg(long)]
    image_type: Option<String>,
    /// `instance_info.image_download_source`.
    #[arg(long)]
    image_download_source: Option<String>,
    /// Override `[DEFAULT]force_raw_images` for this request.
    #[arg(long)]
    force_raw: Option<bool>,
    /// Override `[agent]stream_raw_images` for this request.
    #[arg(long)]
    stream_raw: Option<bool>,
}

/// Arguments of a one-shot prepare.
#[derive(Debug, Args)]
pub struct PrepareArgs {
    #[command(flatten)]
    node: NodeArgs,
    #[command(flatten)]
    image: ImageArgs,
}

/// A one-shot command's request, its node read from `--node`; or, when
/// that is not a node UUID, the answer the command prints:
/// `invalid_node_uuid` echoing it as given (see `pipeline::refused`).
fn one_shot(
    action: Action,
    node: NodeArgs,
    image: Option<ImageArgs>,
    host: &str,
) -> std::result::Result<Request, Box<Completion>> {
    let content = content(image);
    match NodeUuid::parse(&node.node) {
        Ok(uuid) => Ok(request(action, Some(uuid), node.request_id, content)),
        Err(e) => {
            let asked = Completion::new(action, Some(node.node), node.request_id, host);
            Err(Box::new(crate::pipeline::refused(asked, &content.0, &e)))
        }
    }
}

/// What a request of the command line asks for its image: the
/// `instance_info` and options of `image` (a prepare's, a warm's).
fn content(image: Option<ImageArgs>) -> (InstanceInfo, Options) {
    match image {
        None => (InstanceInfo::default(), Options::default()),
        Some(i) => (
            InstanceInfo {
                image_source: i.image_source,
                image_checksum: i.checksum,
                image_os_hash_algo: i.os_hash_algo,
                image_os_hash_value: i.os_hash_value,
                image_disk_format: i.disk_format,
                image_type: i.image_type,
                image_download_source: i.image_download_source,
                ..InstanceInfo::default()
            },
            Options {
                force_raw: i.force_raw,
                stream_raw: i.stream_raw,
            },
        ),
    }
}

/// The request of the command line for `node` (none for a warm).
fn request(
    action: Action,
    node: Option<NodeUuid>,
    request_id: Option<String>,
    (instance_info, options): (InstanceInfo, Options),
) -> Request {
    Request {
        action,
        node,
        request_id,
        instance_info,
        options,
        node_info: Default::default(),
        only_if_prepared: false,
        slow: Default::default(),
        turn: Default::default(),
        issued_ms: None,
        notified: false,
    }
}

/// Whether log lines get ANSI colours: only on a terminal (not in a file or
/// the journal), and never when `NO_COLOR` is set to anything non-empty.
fn colour_logs() -> bool {
    use std::io::IsTerminal;
    std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}

/// Sets up logging on stderr (`RUST_LOG` filters, default `info`).
pub fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        // The AMQP library's own error lines repeat (as dumps) what the
        // worker logs of every failure with its broker and a hint.
        tracing_subscriber::EnvFilter::new("info,lapin=off")
    });
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(colour_logs())
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Human => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
}

/// Entry point of the binary: reads the configuration, sets up logging as
/// it says, then runs the command. A fatal error is printed as its
/// message alone (its code is for completion events).
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Command::ConvertChild {
        src,
        dst,
        sha512,
        no_md5,
        grow_to,
    } = &cli.command
    {
        let served = crate::image::convert::Served {
            md5: !no_md5,
            sha512: *sha512,
        };
        return crate::image::convert::child_main(src, dst, served, *grow_to);
    }
    let files = configuration::files(cli.config.as_ref(), cli.ironic_config.as_ref());
    let env: Vec<(String, String)> = std::env::vars().collect();
    let loaded = crate::config::read(&files, &env, &cli.set);
    match &cli.command {
        Command::Config(ConfigCommand::Check) => return configuration::check(loaded, &files),
        Command::Config(ConfigCommand::Show) => return configuration::show(loaded, &files),
        _ => {}
    }
    let mut loaded = match loaded {
        Ok(loaded) => loaded,
        Err(problems) => {
            eprintln!("ironic-image-worker: the configuration is refused:");
            for problem in problems {
                eprintln!("  {problem}");
            }
            return ExitCode::FAILURE;
        }
    };
    let format = LogFormat::or_configured(cli.log_format, loaded.config.log.format);
    init_logging(format);
    // The access log follows the format in force, the flag's included.
    loaded.config.log.format = match format {
        LogFormat::Human => crate::config::LogFormat::Text,
        LogFormat::Json => crate::config::LogFormat::Json,
    };
    // Commands that act on the cache or serve say what is likely wrong;
    // clients of a running worker (send, retire, cache list, inspect) do not.
    let acts = matches!(
        cli.command,
        Command::Serve
            | Command::Prepare(_)
            | Command::Deployed(_)
            | Command::Cleanup(_)
            | Command::Cache(CacheCommand::Clean { .. })
    );
    for warning in loaded.warnings.iter().filter(|_| acts) {
        tracing::warn!("{warning}");
    }
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("ironic-image-worker: cannot start runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli.command, loaded, &files)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("ironic-image-worker: {}", e.message);
            ExitCode::FAILURE
        }
    }
}

async fn run(
    command: Command,
    mut loaded: crate::config::Loaded,
    files: &crate::config::Files,
) -> Result<ExitCode> {
    let host = loaded.config.default.host.clone();
    let request = match command {
        Command::Serve => {
            let problems = loaded.check_dirs();
            if !problems.is_empty() {
                return Err(crate::config::refusal(&problems));
            }
            crate::service::serve(loaded.config, &configuration::describe(files)).await?;
            return Ok(ExitCode::SUCCESS);
        }
        Command::Inspect { file } => return Ok(inspect(&loaded.config, &file)),
        // A listing only reads: anyone who can read the cache may run it.
        Command::Cache(CacheCommand::List { json }) => return cache_list(&loaded.config, json),
        Command::Cache(cmd) => {
            refuse_foreign_cache(&loaded.config)?;
            return cache_command(loaded.config, cmd);
        }
        Command::ConvertChild { .. } | Command::Config(_) => return Ok(ExitCode::FAILURE),
        Command::Prepare(args) => one_shot(Action::Prepare, args.node, Some(args.image), &host),
        Command::Deployed(args) => one_shot(Action::Deployed, args, None, &host),
        Command::Cleanup(args) => one_shot(Action::Cleanup, args, None, &host),
        Command::Send(args) => return send::send_command(&loaded.config, args).await,
        Command::Retire { conductor } => {
            let settings = crate::broker::Settings::of(&loaded.config)?;
            let deleted = crate::cli::send::retire(&settings, &conductor).await?;
            println!("{}", serde_json::json!({"deleted_queues": deleted}));
            return Ok(ExitCode::SUCCESS);
        }
    };
    let config = loaded.config;
    refuse_foreign_cache(&config)?;
    let request = match request {
        Ok(request) => request,
        Err(refused) => return Ok(print_completion(&refused)),
    };
    let metrics = Arc::new(Metrics::new());
    let pipeline = Pipeline::new(config, metrics.clone())?;
    pipeline.recover()?;
    let bar = std::io::stderr()
        .is_terminal()
        .then(|| tokio::spawn(progress_bar(metrics)));
    let done = pipeline.handle(&request).await;
    if let Some(bar) = bar {
        bar.abort();
        eprintln!();
    }
    Ok(print_completion(&done))
}

/// The name of the user `uid` in the system's user database, if it has
/// one: what `runuser -u` takes, in a hint that names the user to run as.
fn user_name(uid: u32) -> Option<String> {
    let mut buf = vec![0u8; 16 << 10];
    let mut user: libc::passwd = unsafe { std::mem::zeroed() };
    let mut found: *mut libc::passwd = std::ptr::null_mut();
    // SAFETY: every pointer is valid for the call; `buf`, which `pw_name`
    // points into, outlives the read of the name below.
    let rc = unsafe {
        libc::getpwuid_r(
            uid,
            &mut user,
            buf.as_mut_ptr().cast(),
            buf.len(),
            &mut found,
        )
    };
    if rc != 0 || found.is_null() || user.pw_name.is_null() {
        return None;
    }
    // SAFETY: a non-null `pw_name` is a NUL-terminated string inside `buf`.
    let name = unsafe { std::ffi::CStr::from_ptr(user.pw_name) };
    name.to_str().ok().map(String::from)
}

/// Refuses to work on a cache another user owns when run as root: every
/// file root makes there (a lock, a temporary, a master) is one the
/// service's user cannot remove, and its next clean-up fails on it. Run
/// the command as the owner instead.
fn refuse_foreign_cache(config: &Config) -> Result<()> {
    use std::os::unix::fs::MetadataExt;
    if !rustix::process::geteuid().is_root() {
        return Ok(());
    }
    let dir = &config.pxe.instance_master_path;
    let owner = dir
        .ancestors()
        .find_map(|d| std::fs::metadata(d).ok())
        .map(|m| m.uid());
    match owner {
        Some(uid) if uid != 0 => {
            let run_as = match user_name(uid) {
                Some(name) => format!("runuser -u {name} -- ironic-image-worker ..."),
                None => format!("setpriv --reuid={uid} --regid=<its group> --clear-groups ..."),
            };
            Err(crate::error::Error::new(
                crate::error::ErrorCode::Internal,
                format!(
                    "[pxe]instance_master_path {} belongs to uid {uid}: run as root, this \
                     command would leave files there the service cannot remove; run it as \
                     that user ({run_as})",
                    dir.display()
                ),
            ))
        }
        _ => Ok(()),
    }
}

/// `cache list`: the masters as a table or JSON, read without opening
/// (or making) anything.
fn cache_list(config: &Config, json: bool) -> Result<ExitCode> {
    let entries = Pipeline::list_cache(config)?;
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&entries).unwrap_or_default()
        );
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "{:<48} {:>12} {:<20} {:>6} {:>9}",
        "IMAGE", "SIZE", "LAST USED (UTC)", "NODES", "CONVERTED"
    );
    for e in entries {
        let when =
            std::time::UNIX_EPOCH + std::time::Duration::from_secs(e.last_used.max(0) as u64);
        let when = httpdate::fmt_http_date(when);
        println!(
            "{:<48} {:>12} {:<20} {:>6} {:>9}",
            e.name,
            e.size,
            &when[5..25],
            e.linked_nodes,
            e.converted
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// Draws the in-flight transfer gauges as a progress bar on a terminal.
async fn progress_bar(metrics: Arc<Metrics>) {
    let bar = indicatif::ProgressBar::new(0).with_style(
        indicatif::ProgressStyle::with_template(
            "{msg:>9} [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec} ETA {eta}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
        .progress_chars("=> "),
    );
    loop {
        for stage in ["download", "convert"] {
            let expected = metrics.in_flight_expected.with_label_values(&[stage]).get();
            let done = metrics.in_flight_done.with_label_values(&[stage]).get();
            if done > 0 || expected > 0 {
                if bar.message() != stage {
                    bar.reset();
                    bar.set_message(stage);
                }
                bar.set_length(expected.max(done) as u64);
                bar.set_position(done as u64);
            }
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
}

/// `cache list` / `cache clean`.
fn cache_command(config: Config, cmd: CacheCommand) -> Result<ExitCode> {
    let (all_unused, dry_run) = match cmd {
        CacheCommand::List { json } => return cache_list(&config, json),
        CacheCommand::Clean {
            all_unused,
            dry_run,
        } => (all_unused, dry_run),
    };
    let pipeline = Pipeline::new(config, Arc::new(Metrics::new()))?;
    if !dry_run {
        pipeline.recover()?;
    }
    let report = pipeline.clean_cache(0, all_unused, dry_run)?;
    println!(
        "{}",
        serde_json::json!({"dry_run": dry_run, "evicted": report.evicted, "freed_bytes": report.freed})
    );
    Ok(ExitCode::SUCCESS)
}

/// `inspect FILE`: format, sizes and the safety verdict as JSON.
fn inspect(config: &Config, file: &std::path::Path) -> ExitCode {
    let verdict = crate::image::inspect::inspect_file(file).and_then(|found| {
        crate::image::inspect::safety_check(file, &found, config.convert.qcow2_limits())?;
        Ok(found)
    });
    let (out, code) = match verdict {
        Ok(found) => (
            serde_json::json!({"format": found.format, "virtual_size": found.virtual_size,
                "file_size": found.file_size, "safe": true}),
            ExitCode::SUCCESS,
        ),
        Err(e) => {
            let format = crate::image::inspect::inspect_file(file)
                .ok()
                .map(|f| f.format);
            (
                serde_json::json!({"format": format, "safe": false,
                    "error": {"code": e.code, "message": e.message}}),
                ExitCode::FAILURE,
            )
        }
    };
    println!("{out}");
    code
}

/// Prints a completion as one JSON line; the exit code says success or error.
pub fn print_completion(done: &Completion) -> ExitCode {
    match done.to_json() {
        Ok(line) => println!("{}", String::from_utf8_lossy(&line)),
        Err(e) => eprintln!("ironic-image-worker: cannot encode completion: {e}"),
    }
    if done.status == Status::Success {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
