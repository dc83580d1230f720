//! `send`: the operator's (and the tests') client. Publishes one command to
//! a worker (or a warm to every worker) through the broker, with a
//! temporary reply queue, and can wait for the completion events.

use super::send_rpc::Transport;
use super::{ImageArgs, content, print_completion, request};
use crate::broker::{Brokers, Topology, WARM_ALL_KEY};
use crate::config::Config;
use crate::error::{Error, ErrorCode, Result};
use crate::messages::Request;
use crate::messages::{Action, Completion};
use crate::node::NodeUuid;
use crate::seal::Sealer;
use clap::{Args, ValueEnum};
use futures_util::StreamExt;
use lapin::options::*;
use lapin::types::FieldTable;
use lapin::{BasicProperties, Confirmation, ConnectionProperties, ExchangeKind};
use std::process::ExitCode;
use std::time::Duration;

/// Whose worker gets a command.
#[derive(Debug, Clone, Copy)]
pub enum Target<'a> {
    /// The worker of this conductor host.
    Host(&'a str),
    /// Every worker of the command exchange (a warm only: `all.image.warm`).
    AllConductors,
}

impl Target<'_> {
    /// The command's routing key on the command exchange.
    fn routing_key(self, action: Action) -> String {
        match (self, action) {
            (Target::AllConductors, _) => WARM_ALL_KEY.to_string(),
            (Target::Host(host), Action::Warm) => format!("{host}.image.warm"),
            (Target::Host(host), action) => format!("{host}.node.{}", action.as_str()),
        }
    }
}

/// How long `send` waits and for how many answers.
#[derive(Debug, Clone, Copy)]
pub struct Wait {
    /// Longest wait.
    pub limit: Duration,
    /// With [`Target::AllConductors`]: stop once this many answered
    /// (without it, every answer within `limit` is collected). One worker
    /// always gives one answer.
    pub expect: Option<usize>,
}

/// Publishes `req` to `target`; with `wait`, returns the completion events
/// that came back: exactly one from one host (or an error after
/// `wait.limit`), from every conductor those that came within the limit.
pub async fn send(
    settings: &crate::broker::Settings,
    target: Target<'_>,
    req: &Request,
    wait: Option<Wait>,
) -> Result<Vec<Completion>> {
    let (conn, name) = connect_first(&settings.amqp).await?;
    let broker = |e: lapin::Error| {
        Error::new(
            ErrorCode::Internal,
            format!("broker {name}: {}", crate::error::error_chain(&e)),
        )
    };
    if let (Some(_), Target::Host(host)) = (wait, target) {
        require_consumer(&conn, &Topology::new(host, &settings.amqp).queue).await?;
    }
    let channel = conn.create_channel().await.map_err(broker)?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .map_err(broker)?;
    let topology = Topology::new(&settings.host, &settings.amqp);
    let (reply, replies) = reply_queue(&channel, &topology).await.map_err(broker)?;
    let correlation = req.request_id.clone().unwrap_or_default();
    let key = target.routing_key(req.action);
    let body = serde_json::to_vec(&req.command_body()).unwrap_or_default();
    let valid = wait.map_or(Duration::from_secs(3600), |w| w.limit);
    let props = crate::broker::seal_command(
        settings.seal.as_deref(),
        command_properties(reply.clone(), &correlation),
        &key,
        &body,
        valid.as_millis() as u64,
    );
    let taken = Taken {
        correlation: &correlation,
        seal: settings.seal.as_deref(),
        queue: reply.as_str(),
    };
    let confirm = channel
        .basic_publish(
            topology.command_exchange.as_str().into(),
            key.as_str().into(),
            BasicPublishOptions {
                mandatory: true,
                ..BasicPublishOptions::default()
            },
            &body,
            props,
        )
        .await
        .map_err(broker)?
        .await
        .map_err(broker)?;
    refused(confirm, &key, target)?;
    let answers = match (wait, target) {
        (None, _) => Vec::new(),
        (Some(w), Target::Host(_)) => {
            vec![await_answer(replies, &taken, w.limit, broker).await?]
        }
        (Some(w), Target::AllConductors) => await_answers(replies, &taken, w, broker).await?,
    };
    let _ = conn.close(200, "bye".into()).await;
    Ok(answers)
}

/// Deletes the command and dead-letter queues of conductor `host`, only
/// while nobody consumes them; returns the names deleted (a queue already
/// gone is not an error).
pub async fn retire(settings: &crate::broker::Settings, host: &str) -> Result<Vec<String>> {
    let (conn, name) = connect_first(&settings.amqp).await?;
    let broker = |e: lapin::Error| {
        Error::new(
            ErrorCode::Internal,
            format!("broker {name}: {}", crate::error::error_chain(&e)),
        )
    };
    let topology = Topology::new(host, &settings.amqp);
    let mut deleted = Vec::new();
    for queue in [&topology.queue, &topology.dead_letter_queue] {
        let channel = conn.create_channel().await.map_err(broker)?;
        let passive = QueueDeclareOptions {
            passive: true,
            ..QueueDeclareOptions::default()
        };
        let Ok(found) = channel
            .queue_declare(queue.as_str().into(), passive, FieldTable::default())
            .await
        else {
            continue;
        };
        if found.consumer_count() > 0 {
            return Err(Error::new(
                ErrorCode::Internal,
                format!(
                    "{queue} has {} consumer(s): the worker of {host} is still running; stop it \
                     first",
                    found.consumer_count()
                ),
            ));
        }
        // Quorum queues do not take `if_unused`: the consumers were counted
        // just before.
        channel
            .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
            .await
            .map_err(broker)?;
        deleted.push(queue.clone());
    }
    let _ = conn.close(200, "bye".into()).await;
    Ok(deleted)
}

/// Fails at once, sending nothing, when no worker consumes `queue`: a
/// `--wait` would otherwise wait its whole timeout for an answer nobody
/// gives (as the deploy interface fails a prepare no worker takes).
async fn require_consumer(conn: &lapin::Connection, queue: &str) -> Result<()> {
    let nobody = |why: String| {
        Error::new(
            ErrorCode::Internal,
            format!("{why}: is that conductor's worker running? Nothing was sent."),
        )
    };
    let probe = conn
        .create_channel()
        .await
        .map_err(|e| nobody(format!("cannot look at {queue}: {e}")))?;
    let passive = QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    };
    match probe
        .queue_declare(queue.into(), passive, FieldTable::default())
        .await
    {
        Ok(q) if q.consumer_count() == 0 => Err(nobody(format!("no worker consumes {queue}"))),
        Ok(_) => {
            let _ = probe.close(200, "bye".into()).await;
            Ok(())
        }
        Err(_) => Err(nobody(format!("there is no queue {queue}"))),
    }
}

/// The properties of a command: JSON, persistent, answered to `reply`
/// with `correlation`, and stamped with when it was issued, so the worker
/// orders it against the node's other commands (docs/contract.md, "Order
/// of a node's commands").
fn command_properties(reply: lapin::types::ShortString, correlation: &str) -> BasicProperties {
    let sent = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let mut headers = FieldTable::default();
    headers.insert(
        "timestamp_in_ms".into(),
        lapin::types::AMQPValue::LongLongInt(sent.as_millis() as i64),
    );
    BasicProperties::default()
        .with_content_type("application/json".into())
        .with_delivery_mode(2)
        .with_timestamp(sent.as_secs())
        .with_headers(headers)
        .with_reply_to(reply)
        .with_correlation_id(correlation.into())
}

/// Declares the command exchange (so a publish before any worker started is
/// not an error) and a temporary reply queue, consumed: its name and its
/// deliveries.
async fn reply_queue(
    channel: &lapin::Channel,
    topology: &Topology,
) -> std::result::Result<(lapin::types::ShortString, lapin::Consumer), lapin::Error> {
    channel
        .exchange_declare(
            topology.command_exchange.as_str().into(),
            ExchangeKind::Topic,
            ExchangeDeclareOptions {
                durable: true,
                ..ExchangeDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await?;
    let reply = channel
        .queue_declare(
            "".into(),
            QueueDeclareOptions {
                exclusive: true,
                auto_delete: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await?;
    let replies = channel
        .basic_consume(
            reply.name().clone(),
            "".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..BasicConsumeOptions::default()
            },
            FieldTable::default(),
        )
        .await?;
    Ok((reply.name().clone(), replies))
}

/// A connection to the first broker of the configured list that answers.
async fn connect_first(amqp: &crate::config::AmqpSection) -> Result<(lapin::Connection, String)> {
    let brokers = Brokers::new(amqp)?;
    let mut failures = Vec::new();
    for index in 0..brokers.len() {
        let attempt = tokio::time::timeout(
            Duration::from_secs(amqp.connect_timeout.max(1)),
            brokers.connect(index, ConnectionProperties::default()),
        )
        .await;
        match attempt {
            Ok(Ok(c)) => return Ok((c, brokers.name(index).to_string())),
            Ok(Err(e)) => failures.push(format!(
                "{}: {}",
                brokers.name(index),
                crate::error::error_chain(&e)
            )),
            Err(_) => failures.push(format!("{}: no connection in time", brokers.name(index))),
        }
    }
    Err(Error::new(
        ErrorCode::Internal,
        format!("no broker reachable: {}", failures.join("; ")),
    ))
}

/// The broker's confirm of a mandatory publish, as an error when the
/// command reached no queue or was refused.
fn refused(confirm: Confirmation, key: &str, target: Target<'_>) -> Result<()> {
    let whose = match target {
        Target::Host(host) => format!("the worker of {host}"),
        Target::AllConductors => "any worker".to_string(),
    };
    match confirm {
        Confirmation::Ack(None) | Confirmation::NotRequested => Ok(()),
        Confirmation::Ack(Some(_)) => Err(Error::new(
            ErrorCode::Internal,
            format!("no queue is bound for {key}: is {whose} running?"),
        )),
        Confirmation::Nack(_) => Err(Error::new(
            ErrorCode::Internal,
            "the broker refused the command",
        )),
    }
}

/// What makes a message on the reply queue an answer to the command sent:
/// its correlation id and, with a seal policy, a seal made for it.
struct Taken<'a> {
    correlation: &'a str,
    seal: Option<&'a Sealer>,
    queue: &'a str,
}

impl Taken<'_> {
    /// Whether `delivery` answers the command (one that is not is said on
    /// stderr when its seal is the reason, and skipped).
    fn answers(&self, delivery: &lapin::message::Delivery) -> bool {
        let ours = delivery
            .properties
            .correlation_id()
            .as_ref()
            .is_some_and(|c| c.as_str() == self.correlation);
        if !ours {
            return false;
        }
        match crate::broker::admit_answer(self.seal, delivery, self.queue) {
            Ok(()) => true,
            Err(why) => {
                eprintln!(
                    "ironic-image-worker: skipped an answer whose seal does not hold ({why:?})"
                );
                false
            }
        }
    }
}

/// The completion on the reply queue that answers the command (`taken`),
/// waited for at most `limit`.
async fn await_answer(
    mut replies: lapin::Consumer,
    taken: &Taken<'_>,
    limit: Duration,
    broker: impl Fn(lapin::Error) -> Error,
) -> Result<Completion> {
    tokio::time::timeout(limit, async {
        while let Some(delivery) = replies.next().await {
            let delivery = delivery.map_err(&broker)?;
            if taken.answers(&delivery) {
                return serde_json::from_slice::<Completion>(&delivery.data).map_err(|e| {
                    Error::new(ErrorCode::Internal, format!("unreadable completion: {e}"))
                });
            }
        }
        Err(Error::new(
            ErrorCode::Internal,
            "the broker closed the reply queue",
        ))
    })
    .await
    .map_err(|_| Error::new(ErrorCode::Internal, format!("no answer within {limit:?}")))?
}

/// The completions on the reply queue that answer the command (`taken`),
/// one per conductor, until `wait.expect` of them came or `wait.limit`
/// passed (not an error: the caller says how many came).
async fn await_answers(
    mut replies: lapin::Consumer,
    taken: &Taken<'_>,
    wait: Wait,
    broker: impl Fn(lapin::Error) -> Error,
) -> Result<Vec<Completion>> {
    let mut answers: Vec<Completion> = Vec::new();
    let deadline = tokio::time::Instant::now() + wait.limit;
    while wait.expect.is_none_or(|n| answers.len() < n) {
        let next = match tokio::time::timeout_at(deadline, replies.next()).await {
            Err(_) => break,
            Ok(None) => {
                return Err(Error::new(
                    ErrorCode::Internal,
                    "the broker closed the reply queue",
                ));
            }
            Ok(Some(delivery)) => delivery.map_err(&broker)?,
        };
        if !taken.answers(&next) {
            continue;
        }
        let done = serde_json::from_slice::<Completion>(&next.data)
            .map_err(|e| Error::new(ErrorCode::Internal, format!("unreadable completion: {e}")))?;
        // A conductor answers once; a second copy (a redelivery) is not news.
        if !answers
            .iter()
            .any(|a| a.conductor_host == done.conductor_host)
        {
            answers.push(done);
        }
    }
    Ok(answers)
}

/// Arguments of `send`: publish a command to a running worker.
#[derive(Debug, Args)]
pub struct SendArgs {
    /// prepare, deployed, cleanup, or warm (cache an image, for no node).
    #[arg(value_enum)]
    action: SendAction,
    /// Node UUID (every action but warm).
    #[arg(long)]
    node: Option<String>,
    /// Request id echoed in the completion event (default: a new UUID).
    #[arg(long)]
    request_id: Option<String>,
    #[command(flatten)]
    image: ImageArgs,
    /// Conductor host whose worker gets the command (default `[DEFAULT]host`).
    #[arg(long, visible_alias = "host")]
    conductor: Option<String>,
    /// warm only: every conductor's worker (`all.image.warm`); waits for
    /// the answers and prints each (implies `--wait`).
    #[arg(long, conflicts_with = "conductor")]
    all_conductors: bool,
    /// With `--all-conductors`: stop waiting once this many answered (the
    /// exit code is non-zero when fewer did within `--timeout`).
    #[arg(long, requires = "all_conductors")]
    expect: Option<usize>,
    /// Wait for the completion event and print it.
    #[arg(long)]
    wait: bool,
    /// Seconds to wait with `--wait` (or `--all-conductors`).
    #[arg(long, default_value_t = 3600)]
    timeout: u64,
    #[command(flatten)]
    rpc: super::send_rpc::RpcArgs,
}

/// Actions a command can carry.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum SendAction {
    /// Cache and publish the image.
    Prepare,
    /// Withdraw URL and link after deployment.
    Deployed,
    /// Remove everything of the node.
    Cleanup,
    /// Cache the image on one conductor (or all), so deploys find it.
    Warm,
}

impl SendAction {
    fn action(self) -> Action {
        match self {
            SendAction::Prepare => Action::Prepare,
            SendAction::Deployed => Action::Deployed,
            SendAction::Cleanup => Action::Cleanup,
            SendAction::Warm => Action::Warm,
        }
    }
}

/// `send`: publishes the command, prints the answers it waited for (one
/// JSON line each); fails when any is an error, or when `--expect`
/// answers did not all come.
pub(super) async fn send_command(config: &Config, args: SendArgs) -> Result<ExitCode> {
    let action = args.action.action();
    let warm = action == Action::Warm;
    if args.all_conductors && !warm {
        return Err(crate::error::Error::new(
            crate::error::ErrorCode::InvalidMessage,
            "--all-conductors is for warm only",
        ));
    }
    // Read here, so a node that is not a node UUID is refused before
    // anything is sent.
    let node = match (warm, args.node) {
        (true, _) => None,
        (false, Some(n)) => Some(NodeUuid::parse(&n)?),
        (false, None) => {
            return Err(crate::error::Error::new(
                crate::error::ErrorCode::InvalidMessage,
                format!("{} needs --node", action.as_str()),
            ));
        }
    };
    let image = matches!(action, Action::Prepare | Action::Warm).then_some(args.image);
    let mut req = request(action, node, args.request_id, content(image));
    let request_id = req
        .request_id
        .get_or_insert_with(|| uuid::Uuid::new_v4().to_string())
        .clone();
    let host = args
        .conductor
        .clone()
        .unwrap_or_else(|| config.default.host.clone());
    let target = match args.all_conductors {
        true => Target::AllConductors,
        false => Target::Host(&host),
    };
    let wait = (args.wait || args.all_conductors).then_some(Wait {
        limit: std::time::Duration::from_secs(args.timeout),
        expect: args.expect,
    });
    let answers = match args.rpc.transport(config) {
        Transport::Amqp => send(&crate::broker::Settings::of(config)?, target, &req, wait).await?,
        Transport::JsonRpc => {
            let routed = args.all_conductors || args.conductor.is_some();
            super::send_rpc::send(config, &args.rpc, routed, &req, wait.map(|w| w.limit)).await?
        }
    };
    if wait.is_none() {
        println!("{}", serde_json::json!({"request_id": request_id}));
        return Ok(ExitCode::SUCCESS);
    }
    let mut ok = !answers.is_empty();
    for done in &answers {
        ok &= print_completion(done) == ExitCode::SUCCESS;
    }
    if let Some(n) = args.expect.filter(|&n| answers.len() < n) {
        eprintln!(
            "ironic-image-worker: {} of the {n} expected conductors answered within {} s",
            answers.len(),
            args.timeout
        );
        ok = false;
    }
    Ok(if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
