-- The broker's tables. {schema} is composed with psycopg.sql.Identifier by migrations.py.

-- Declared queues. A queue needs no row to receive messages; the row carries the
-- RabbitMQ-style arguments (x-expires, x-message-ttl, x-max-priority).
CREATE TABLE {schema}.queue (
    name text PRIMARY KEY,
    expires interval,
    message_ttl interval,
    max_priority smallint,
    declared_at timestamptz NOT NULL DEFAULT now(),
    -- refreshed by consumers while they consume; x-expires counts from here
    used_at timestamptz NOT NULL DEFAULT now()
);

-- Exchanges and bindings are shared, so a message published in one process is
-- routed by bindings declared in another (Celery's remote control replies need it).
CREATE TABLE {schema}.exchange (
    name text PRIMARY KEY,
    type text NOT NULL CHECK (type IN ('direct', 'topic', 'fanout')),
    declared_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE {schema}.binding (
    exchange text NOT NULL,
    routing_key text NOT NULL,
    queue text NOT NULL,
    -- anchored regular expression for topic exchanges, NULL otherwise
    pattern text,
    PRIMARY KEY (exchange, routing_key, queue)
);

CREATE INDEX binding_queue_idx ON {schema}.binding (queue);

CREATE TABLE {schema}.message (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    queue text NOT NULL,
    -- AMQP order: higher first
    priority smallint NOT NULL DEFAULT 0,
    -- true while an ETA lies ahead; the poll statement clears it when due, so the
    -- claim index never has to step over millions of future messages
    delayed boolean NOT NULL DEFAULT false,
    -- visible from this time on: the ETA while delayed, the lease end while leased
    next_iteration timestamptz NOT NULL DEFAULT now(),
    attempts integer NOT NULL DEFAULT 0,
    -- the current delivery's fencing token; ack and renew must present it
    lease bigint,
    expires_at timestamptz,
    dedup_key text,
    created_at timestamptz NOT NULL DEFAULT now(),
    body bytea NOT NULL,
    content_type text,
    content_encoding text,
    -- json, not jsonb: stored as sent, no parse on the hot path
    headers json NOT NULL,
    properties json NOT NULL
);

-- The claim walks this index in delivery order and stops after LIMIT rows.
CREATE INDEX message_ready_idx ON {schema}.message (queue, priority DESC, id)
    WHERE NOT delayed;

CREATE INDEX message_delayed_idx ON {schema}.message (next_iteration)
    WHERE delayed;

CREATE INDEX message_expires_idx ON {schema}.message (expires_at)
    WHERE expires_at IS NOT NULL;

-- One waiting or running message per (queue, dedup_key); NULL keys are never equal.
CREATE UNIQUE INDEX message_dedup_idx ON {schema}.message (queue, dedup_key)
    WHERE dedup_key IS NOT NULL;

-- Messages that were rejected or ran out of attempts. Nothing leaves the broker
-- without an ack or a row here.
CREATE TABLE {schema}.dead_letter (
    id bigint PRIMARY KEY,
    queue text NOT NULL,
    priority smallint NOT NULL,
    attempts integer NOT NULL,
    reason text NOT NULL,
    created_at timestamptz NOT NULL,
    died_at timestamptz NOT NULL DEFAULT now(),
    body bytea NOT NULL,
    content_type text,
    content_encoding text,
    headers json NOT NULL,
    properties json NOT NULL
);

CREATE INDEX dead_letter_queue_idx ON {schema}.dead_letter (queue, died_at);
