/**
 * The client: `Client` -> `Model` -> `Session`, on `@grpc/grpc-js` (the twin of the Python
 * SDK's `AsyncClient`; everything that is not I/O lives in `base.ts`).
 */

import * as grpc from "@grpc/grpc-js";

import * as base from "./base";
import { Cancelled, errorForStatus, fromRpcError, isStatusError, NotFound, Status } from "./errors";
import type * as pbm from "./gen/hotloop/v1/model";
import { ModelServiceService } from "./gen/hotloop/v1/model";
import type { ListApplicationsRequest } from "./gen/hotloop/v1/serve_proxy";
import type * as pbs from "./gen/hotloop/v1/session";
import { SessionServiceService } from "./gen/hotloop/v1/session";
import {
  type Chunk,
  type HistoryLike,
  type ModelInfo,
  type SessionInfo,
  type Settings,
  SETTINGS_FIELDS,
  type Usage,
} from "./types";

/** Options of `new Client(address, options)`. */
export interface ClientOptions {
  /** Bearer token, sent as `authorization: Bearer <token>` with every call. */
  token?: string;
  /** Use TLS (with the system's roots unless `rootCertificates` is given). */
  tls?: boolean;
  /** PEM roots to trust; giving them implies TLS. */
  rootCertificates?: Buffer;
  /** Default deadline of every call, in milliseconds (a call's own `timeoutMs` wins). */
  timeoutMs?: number;
  /** First pause of the automatic retries after a failover (default 200 ms; then doubling,
   * jittered, up to five retries). */
  retryDelayMs?: number;
  /** grpc-js channel options (`grpc.max_receive_message_length`, ...). */
  channelOptions?: grpc.ChannelOptions;
  /**
   * Servers with `server.direct_ingress` (plaintext inside the cluster): each session's turns
   * (`generate`) go straight to the replica holding its cache, found through `ListReplicas`
   * and the router's own hash, skipping Ray's proxy and most of its per-message CPU; all else,
   * and a turn whose replica is unknown or just failed, goes through the proxy. Not with TLS.
   */
  direct?: boolean;
}

/** Options every call takes. */
export interface CallOptions {
  /** Deadline of the call in milliseconds, shared by its attempts (a retry cannot double it). */
  timeoutMs?: number;
  /** Aborting cancels the call on the server; the call then rejects with `Cancelled`. */
  signal?: AbortSignal;
}

/** Options of `model.newSession()`. */
export interface NewSessionOptions extends CallOptions {
  /** The session's settings, sent with every request of the session. */
  settings?: Settings;
}

/** Options of `session.generate()`: call options, tools, plus per-turn settings overrides. */
export type GenerateOptions = CallOptions & base.ToolOptions & Settings;

const GENERATE_OPTION_NAMES: ReadonlySet<string> = new Set<string>([
  ...SETTINGS_FIELDS,
  "timeoutMs",
  "signal",
  "tools",
  "toolChoice",
  "parallelToolCalls",
]);

interface UnaryMethod<Req, Res> {
  readonly path: string;
  readonly requestSerialize: (value: Req) => Buffer;
  readonly responseDeserialize: (value: Buffer) => Res;
}

const ZERO_USAGE = { promptTokens: 0, cachedTokens: 0, restoredTokens: 0, prefilledTokens: 0, completionTokens: 0 };

const LIST_APPLICATIONS: UnaryMethod<ListApplicationsRequest, string[]> = {
  path: base.LIST_APPLICATIONS_METHOD,
  requestSerialize: base.encodeListApplications,
  responseDeserialize: base.decodeApplicationNames,
};

function channelCredentials(options: ClientOptions): grpc.ChannelCredentials {
  // Giving rootCertificates implies TLS: asking to trust a CA over plaintext is a
  // configuration mistake, not a request for plaintext.
  if (!options.tls && options.rootCertificates === undefined) return grpc.credentials.createInsecure();
  return grpc.credentials.createSsl(options.rootCertificates ?? null);
}

function cancelledBy(signal: AbortSignal, cause?: unknown): Cancelled {
  return new Cancelled("cancelled by the caller (AbortSignal)", Status.CANCELLED, { cause: signal.reason ?? cause });
}

function sleep(ms: number, signal: AbortSignal | undefined): Promise<void> {
  return new Promise((resolve, reject) => {
    if (signal?.aborted) {
      reject(cancelledBy(signal));
      return;
    }
    const onAbort = (): void => {
      clearTimeout(timer);
      reject(cancelledBy(signal as AbortSignal));
    };
    const timer = setTimeout(() => {
      signal?.removeEventListener("abort", onAbort);
      resolve();
    }, ms);
    signal?.addEventListener("abort", onAbort, { once: true });
  });
}

/**
 * The channel and the call plumbing shared by a client's models and sessions.
 * @internal Not part of the public API (not exported from the package).
 */
export class Transport {
  readonly retryDelayMs: number;
  private readonly credentials: grpc.ChannelCredentials;
  private lazy: grpc.Client | undefined;
  /** By model, with `direct`. */
  private readonly routes = new Map<string, base.DirectRoutes>();
  /** By direct address: the replica's own server. */
  private readonly replicas = new Map<string, grpc.Client>();

  constructor(
    readonly address: string,
    private readonly options: ClientOptions,
  ) {
    if (!address) throw new TypeError("address must be host:port");
    if (options.direct && (options.tls || options.rootCertificates !== undefined)) {
      throw new TypeError("direct: true talks plaintext to replicas inside the cluster: not with TLS");
    }
    this.credentials = channelCredentials(options);
    this.retryDelayMs = options.retryDelayMs ?? 200;
  }

  /** The grpc-js client (one channel), made on first use and again after `close()`. */
  get grpc(): grpc.Client {
    this.lazy ??= new grpc.Client(this.address, this.credentials, this.options.channelOptions ?? {});
    return this.lazy;
  }

  get tls(): boolean {
    return this.options.tls === true || this.options.rootCertificates !== undefined;
  }

  close(): void {
    this.lazy?.close();
    this.lazy = undefined;
    for (const replica of this.replicas.values()) replica.close();
    this.replicas.clear();
    this.routes.clear();
  }

  /**
   * Where a session's turn goes: with `direct`, the replica owning its key and that replica's
   * address (`base.DirectRoutes`); else, or where unknown, the proxy and undefined.
   */
  private async generateTarget(model: string, key: string): Promise<[grpc.Client, string | undefined]> {
    if (!this.options.direct) return [this.grpc, undefined];
    let routes = this.routes.get(model);
    if (routes === undefined || routes.stale(Date.now())) {
      let response: pbm.ListReplicasResponse | undefined;
      try {
        response = await this.unaryOnce(
          ModelServiceService.listReplicas,
          { model },
          model,
          Date.now() + base.DEFAULT_UNARY_TIMEOUT_MS,
          undefined,
          undefined,
        );
      } catch {
        response = undefined; // an older server (UNIMPLEMENTED), or none reachable: the proxy for now
      }
      const fresh = new base.DirectRoutes(response, Date.now());
      if (routes !== undefined) fresh.inherit(routes);
      this.routes.set(model, (routes = fresh));
    }
    const address = routes.addressFor(key, Date.now());
    if (address === undefined) return [this.grpc, undefined];
    let replica = this.replicas.get(address);
    if (replica === undefined) {
      replica = new grpc.Client(address, grpc.credentials.createInsecure(), this.options.channelOptions ?? {});
      this.replicas.set(address, replica);
    }
    return [replica, address];
  }

  metadata(application: string | undefined, sessionKey?: string): grpc.Metadata {
    return base.callMetadata(application, this.options.token, sessionKey);
  }

  /** The call's absolute deadline (ms since the epoch); a call's `timeoutMs` wins. */
  deadline(timeoutMs: number | undefined, unary = false): number {
    const ms = timeoutMs ?? this.options.timeoutMs ?? (unary ? base.DEFAULT_UNARY_TIMEOUT_MS : undefined);
    return ms === undefined ? Infinity : Date.now() + ms;
  }

  /** The SDK error for a failed call (abort wins; non-gRPC errors pass through). */
  error(err: unknown, signal: AbortSignal | undefined): unknown {
    if (signal?.aborted) return cancelledBy(signal, err);
    return isStatusError(err) ? fromRpcError(err) : err;
  }

  private unaryOnce<Req, Res>(
    method: UnaryMethod<Req, Res>,
    request: Req,
    application: string | undefined,
    deadline: number,
    signal: AbortSignal | undefined,
    sessionKey: string | undefined,
  ): Promise<Res> {
    return new Promise<Res>((resolve, reject) => {
      if (signal?.aborted) {
        reject(cancelledBy(signal));
        return;
      }
      const call = this.grpc.makeUnaryRequest(
        method.path,
        method.requestSerialize,
        method.responseDeserialize,
        request,
        this.metadata(application, sessionKey),
        { deadline },
        (err, response) => {
          signal?.removeEventListener("abort", onAbort);
          if (err) reject(err);
          else resolve(response as Res);
        },
      );
      const onAbort = (): void => call.cancel();
      signal?.addEventListener("abort", onAbort, { once: true });
    });
  }

  /** One unary call, retried with backoff after a failover, errors translated. */
  async unary<Req, Res>(
    method: UnaryMethod<Req, Res>,
    request: Req,
    application: string | undefined,
    options: CallOptions,
    sessionKey?: string,
  ): Promise<Res> {
    const deadline = this.deadline(options.timeoutMs, true);
    for (let attempt = 1; ; attempt++) {
      try {
        return await this.unaryOnce(method, request, application, deadline, options.signal, sessionKey);
      } catch (err) {
        if (options.signal?.aborted || !base.shouldRetryUnary(err, attempt)) throw this.error(err, options.signal);
      }
      await sleep(base.backoffMs(this.retryDelayMs, attempt), options.signal);
    }
  }

  /**
   * An ExportSession stream collected into one blob. Exporting only reads, so a failover
   * restarts it from the beginning (with backoff), like a unary call.
   */
  async exportBlob(
    request: pbs.ExportSessionRequest,
    application: string,
    options: CallOptions,
    sessionKey: string,
  ): Promise<Uint8Array> {
    const { signal } = options;
    const deadline = this.deadline(options.timeoutMs, true);
    const method = SessionServiceService.exportSession;
    for (let attempt = 1; ; attempt++) {
      if (signal?.aborted) throw cancelledBy(signal);
      const call: grpc.ClientReadableStream<pbs.ExportSessionChunk> = this.grpc.makeServerStreamRequest(
        method.path,
        method.requestSerialize,
        method.responseDeserialize,
        request,
        this.metadata(application, sessionKey),
        { deadline },
      );
      call.on("error", () => {}); // the status reaches the loop below
      const onAbort = (): void => call.cancel();
      signal?.addEventListener("abort", onAbort, { once: true });
      const parts: Buffer[] = [];
      let total: bigint | undefined;
      try {
        for await (const pb of call as AsyncIterable<pbs.ExportSessionChunk>) {
          parts.push(pb.data);
          total = pb.totalBytes;
        }
        const blob = Buffer.concat(parts);
        if (total !== undefined && BigInt(blob.length) !== total) {
          throw errorForStatus(Status.DATA_LOSS, `the export stream ended after ${blob.length} of ${total} bytes`);
        }
        return new Uint8Array(blob.buffer, blob.byteOffset, blob.byteLength);
      } catch (err) {
        if (signal?.aborted || !base.shouldRetryUnary(err, attempt)) throw this.error(err, signal);
      } finally {
        signal?.removeEventListener("abort", onAbort);
        call.cancel();
      }
      await sleep(base.backoffMs(this.retryDelayMs, attempt), signal);
    }
  }

  /** A Generate stream: retried with backoff before any text, `TurnInterrupted` after. */
  async *generate(request: pbs.GenerateRequest, application: string, options: CallOptions): AsyncGenerator<Chunk> {
    const { signal } = options;
    const deadline = this.deadline(options.timeoutMs);
    const method = SessionServiceService.generate;
    const progress = new base.StreamProgress();
    const key = base.routingKey(request.sessionId);
    let proxy = false; // true once this turn's replica refused it directly (full): the proxy's now
    for (;;) {
      if (signal?.aborted) throw cancelledBy(signal);
      const [target, direct]: [grpc.Client, string | undefined] = proxy
        ? [this.grpc, undefined]
        : await this.generateTarget(application, key);
      const call: grpc.ClientReadableStream<pbs.GenerateChunk> = target.makeServerStreamRequest(
        method.path,
        method.requestSerialize,
        method.responseDeserialize,
        request,
        this.metadata(application, key),
        { deadline },
      );
      // The status also reaches the loop below; this keeps a late one (after an early
      // `break` destroyed the stream) from becoming an unhandled 'error' event.
      call.on("error", () => {});
      const onAbort = (): void => call.cancel();
      signal?.addEventListener("abort", onAbort, { once: true });
      try {
        for await (const pb of call as AsyncIterable<pbs.GenerateChunk>) {
          const chunk = base.chunkFromProto(pb);
          progress.delivered(chunk);
          yield chunk;
          if (signal?.aborted) throw cancelledBy(signal);
        }
        return;
      } catch (err) {
        if (signal?.aborted) throw cancelledBy(signal, err);
        if (direct !== undefined && progress.directRefused(err)) {
          proxy = true;
          continue; // no pause: the proxy has the replica's other slots
        }
        if (direct !== undefined && base.retriable(err)) this.routes.get(application)?.failed(direct, Date.now());
        if (!progress.shouldRetry(err)) throw progress.error(err);
      } finally {
        signal?.removeEventListener("abort", onAbort);
        // Frees the server's slot at once on return() (a `break` out of `for await`), abort
        // or error; a no-op once the stream has ended.
        call.cancel();
      }
      await sleep(base.backoffMs(this.retryDelayMs, progress.attempts - 1), signal);
    }
  }
}

/**
 * A connection to hotloop-serve (Ray Serve's gRPC proxy).
 *
 * ```ts
 * const client = new Client("127.0.0.1:9000", { token });
 * const session = await client.model("gemma-3-270m").newSession({ settings: { temperature: 0 } });
 * for await (const chunk of session.generate([{ role: "user", content: "Hello!" }])) {
 *   process.stdout.write(chunk.text);
 * }
 * client.close();
 * ```
 *
 * The channel opens on the first call; `close()` closes it (a later call opens a new one).
 */
export class Client {
  readonly #transport: Transport;

  constructor(address: string, options: ClientOptions = {}) {
    this.#transport = new Transport(address, options);
  }

  /** The server's `host:port`. */
  get address(): string {
    return this.#transport.address;
  }

  /** The Ray Serve applications behind the proxy (one per served model). */
  async applicationNames(options: CallOptions = {}): Promise<string[]> {
    return this.#transport.unary(LIST_APPLICATIONS, {}, undefined, options);
  }

  /**
   * Every model the server serves.
   *
   * Asks Ray Serve's proxy for its applications first, then the first one for the list
   * (every application knows every model of the config). A server that is not behind
   * Ray Serve (ListApplications UNIMPLEMENTED) is asked directly.
   */
  async listModels(options: CallOptions = {}): Promise<ModelInfo[]> {
    let application: string | undefined;
    try {
      const names = await this.applicationNames(options);
      if (names.length === 0) return [];
      application = names[0];
    } catch (err) {
      if (!(base.isHotloopError(err) && err.code === Status.UNIMPLEMENTED)) throw err;
    }
    const response = await this.#transport.unary(ModelServiceService.listModels, {}, application, options);
    return response.models.map(base.modelInfoFromProto);
  }

  /** A handle on one served model (no call is made until you use it). */
  model(name: string): Model {
    return new Model(this.#transport, name);
  }

  /** Close the channel; sessions are not closed on the server (they expire there). */
  close(): void {
    this.#transport.close();
  }

  toString(): string {
    return `<Client ${this.address} (${this.#transport.tls ? "tls" : "plaintext"})>`;
  }
}

/** One served model; every call it makes is routed to the Ray Serve app of that name. */
export class Model {
  readonly #transport: Transport;
  /** The model's name (its Ray Serve application). */
  readonly name: string;

  /** @internal Use `client.model(name)`. */
  constructor(transport: Transport, name: string) {
    if (!name) throw new TypeError("model name is empty");
    this.#transport = transport;
    this.name = name;
  }

  /** The model's architecture, context length, quantization, replicas (GetModel). */
  async info(options: CallOptions = {}): Promise<ModelInfo> {
    const pb = await this.#transport.unary(ModelServiceService.getModel, { model: this.name }, this.name, options);
    return base.modelInfoFromProto(pb);
  }

  /** Token ids of `text` under the model's vocabulary. */
  async tokenize(text: string, options: CallOptions & { addSpecial?: boolean } = {}): Promise<number[]> {
    const request = { model: this.name, text, addSpecial: options.addSpecial ?? false };
    const pb = await this.#transport.unary(ModelServiceService.tokenize, request, this.name, options);
    return pb.tokens;
  }

  /** Create a session (a conversation whose KV cache stays hot between turns). */
  async newSession(options: NewSessionOptions = {}): Promise<Session> {
    const settings = base.cleanSettings(options.settings ?? {});
    const request = base.createSessionRequest(this.name, settings, base.newSessionKey());
    const pb = await this.#transport.unary(
      SessionServiceService.createSession,
      request,
      this.name,
      options,
      request.sessionKey,
    );
    const state = new base.SessionState(pb.id, this.name, settings);
    state.apply(pb, settings);
    return new Session(this.#transport, state);
  }

  /** Your sessions of this model on every replica, most recently used first. */
  async listSessions(options: CallOptions = {}): Promise<SessionInfo[]> {
    const request = { model: this.name };
    const pb = await this.#transport.unary(SessionServiceService.listSessions, request, this.name, options);
    return pb.sessions.map(base.sessionInfoFromProto);
  }

  /**
   * A new session from `session.export()`'s bytes (from this server or another serving the
   * same model); its next turn reuses the imported cache. `settings` replace the exported
   * session's own. The blob goes in order, in parts of at most 1 MiB, every part with the same
   * routing key (so every part reaches the same replica). A blob that is corrupt or from
   * another model rejects with `InvalidArgument` or `FailedPrecondition`.
   */
  async importSession(data: Uint8Array, settings?: Settings, options: CallOptions = {}): Promise<Session> {
    const cleaned = settings === undefined ? undefined : base.cleanSettings(settings);
    const key = base.newSessionKey();
    let pb: pbs.Session | undefined;
    for (const request of base.importRequests(this.name, key, data, cleaned)) {
      pb = await this.#transport.unary(SessionServiceService.importSession, request, this.name, options, key);
    }
    // The call with the last part returns the session (there is always one part at least).
    if (pb === undefined || !pb.id) throw new Error("ImportSession returned no session");
    const state = new base.SessionState(pb.id, this.name, cleaned ?? {});
    state.apply(pb, cleaned ?? {});
    return new Session(this.#transport, state);
  }

  /**
   * A handle on an existing session by its id (e.g. one created by another process, whose
   * id you stored); no call is made. `settings` are the ones to send with its requests.
   */
  session(id: string, options: { settings?: Settings } = {}): Session {
    if (!id) throw new TypeError("session id is empty");
    return new Session(this.#transport, new base.SessionState(id, this.name, base.cleanSettings(options.settings ?? {})));
  }

  toString(): string {
    return `<Model ${JSON.stringify(this.name)} at ${this.#transport.address}>`;
  }
}

/** A conversation whose KV cache stays hot on the server between turns. */
export class Session {
  readonly #transport: Transport;
  readonly #state: base.SessionState;

  /** @internal Use `model.newSession()` or `model.session(id)`. */
  constructor(transport: Transport, state: base.SessionState) {
    this.#transport = transport;
    this.#state = state;
  }

  /** The server's session id. */
  get id(): string {
    return this.#state.id;
  }

  /** The model's name. */
  get model(): string {
    return this.#state.model;
  }

  /** The settings sent with every request of this session (a copy). */
  get settings(): Settings {
    return base.cleanSettings(this.#state.settings);
  }

  /** Whether `close()` has been called. */
  get closed(): boolean {
    return this.#state.closed;
  }

  #call<Req, Res>(method: UnaryMethod<Req, Res>, request: Req, options: CallOptions): Promise<Res> {
    return this.#transport.unary(method, request, this.#state.model, options, base.routingKey(this.#state.id));
  }

  /**
   * Stream the reply to `history` (all of the conversation, oldest first); use with
   * `for await`. The last chunk carries `usage`, `finishReason`, `timings` and `servedBy`.
   *
   * `options` takes per-turn settings overrides (`{temperature: 0, stop: ["\n"]}`), layered
   * over the session's settings, plus `signal` and `timeoutMs`. Aborting the signal, or
   * leaving the loop early (`break`), cancels the call on the server; an abort rejects with
   * `Cancelled`. If the replica fails before any text arrived the request is re-sent once;
   * after text arrived it throws `TurnInterrupted` (with `partialText`).
   *
   * A bad history (empty, unknown role) throws `TypeError` here, before any RPC.
   */
  generate(history: HistoryLike, options: GenerateOptions = {}): AsyncGenerator<Chunk, void, undefined> {
    for (const key of Object.keys(options)) {
      if (!GENERATE_OPTION_NAMES.has(key)) throw new TypeError(`unknown generate() option ${JSON.stringify(key)}`);
    }
    const { signal, timeoutMs, tools, toolChoice, parallelToolCalls, ...overrides } = options;
    const toolOptions: base.ToolOptions = {};
    if (tools !== undefined) toolOptions.tools = tools;
    if (toolChoice !== undefined) toolOptions.toolChoice = toolChoice;
    if (parallelToolCalls !== undefined) toolOptions.parallelToolCalls = parallelToolCalls;
    const request = this.#state.generateRequest(history, overrides, toolOptions);
    const callOptions: CallOptions = {};
    if (signal !== undefined) callOptions.signal = signal;
    if (timeoutMs !== undefined) callOptions.timeoutMs = timeoutMs;
    return this.#transport.generate(request, this.#state.model, callOptions);
  }

  /**
   * Stream a new version of `history`'s last reply (`history` must end with an assistant
   * message, which is dropped). The client owns the history: rewinding is sending a shorter or
   * edited one, and the server reuses the cache up to the first token that differs (see
   * `withMessageReplaced`).
   */
  regenerate(history: HistoryLike, options: GenerateOptions = {}): AsyncGenerator<Chunk, void, undefined> {
    return this.generate(base.withoutLastReply(history), options);
  }

  /**
   * A new session starting with this one's cache: all of it, or only up to `history` (a
   * prefix of this session's conversation, e.g. its first k messages). Copied in the server's
   * KV cache, not prefilled again: the fork's next turn reports those tokens as cached.
   * `settings` default to this session's.
   */
  async fork(history?: HistoryLike, settings?: Settings, options: CallOptions = {}): Promise<Session> {
    const chosen = base.cleanSettings(settings ?? this.#state.settings);
    const request = base.forkRequest(this.id, history, chosen, base.newSessionKey());
    const pb = await this.#call(SessionServiceService.forkSession, request, options);
    const state = new base.SessionState(pb.id, this.#state.model, chosen);
    state.apply(pb, chosen);
    return new Session(this.#transport, state);
  }

  /**
   * The session's cache (tokens, KV state, settings, the model's fingerprint) as one
   * self-checking blob, for `model.importSession()` on any server of the same model.
   */
  async export(options: CallOptions = {}): Promise<Uint8Array> {
    return this.#transport.exportBlob({ sessionId: this.id }, this.#state.model, options, base.routingKey(this.id));
  }

  /** Prefill `history` (e.g. a system prompt) into the cache without generating. */
  async warmup(history: HistoryLike, options: CallOptions = {}): Promise<Usage> {
    const pb = await this.#call(SessionServiceService.warmup, this.#state.warmupRequest(history), options);
    return base.usageFromProto(pb.usage ?? ZERO_USAGE);
  }

  /** The server's view of the session (context tokens, state, settings). */
  async info(options: CallOptions = {}): Promise<SessionInfo> {
    const pb = await this.#call(SessionServiceService.getSession, { sessionId: this.id }, options);
    return base.sessionInfoFromProto(pb);
  }

  /** Tokens held in the session's KV cache on the server. */
  async context(options: CallOptions = {}): Promise<number> {
    return (await this.info(options)).contextTokens;
  }

  /** Replace the session's settings (unset fields take the server's defaults). */
  async setSettings(settings: Settings, options: CallOptions = {}): Promise<Settings> {
    const request = { sessionId: this.id, settings: base.settingsToProto(settings) };
    const pb = await this.#call(SessionServiceService.updateSettings, request, options);
    this.#state.apply(pb, settings);
    return this.settings;
  }

  /** Drop the session's KV cache; the next turn prefills its history from scratch. */
  async clearCache(options: CallOptions = {}): Promise<void> {
    await this.#call(SessionServiceService.clearCache, { sessionId: this.id }, options);
  }

  /** Free the session on the server. Idempotent; a session already gone is fine. */
  async close(options: CallOptions = {}): Promise<void> {
    if (this.#state.closed) return;
    try {
      await this.#call(SessionServiceService.closeSession, { sessionId: this.id }, options);
    } catch (err) {
      if (!(err instanceof NotFound)) throw err; // the server forgot it already: closed is closed
    }
    this.#state.closed = true;
  }

  toString(): string {
    return `<Session ${this.id} model=${JSON.stringify(this.model)}${this.closed ? " closed" : ""}>`;
  }
}
