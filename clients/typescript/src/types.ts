/**
 * The SDK's value types: plain readonly objects, so callers never handle protobuf messages.
 *
 * They mirror the messages of `protos/hotloop/v1` field by field (in camelCase), like the
 * Python SDK's dataclasses; the conversions live in `base.ts` (one function per direction).
 */

/** Who wrote a message. The values are the role names chat templates use. */
export type Role = "system" | "user" | "assistant" | "tool";
export const Role = {
  SYSTEM: "system",
  USER: "user",
  ASSISTANT: "assistant",
  /** A tool's result; `Message.toolCallId` names the call it answers. */
  TOOL: "tool",
} as const satisfies Record<string, Role>;

/** Why a reply ended (only on the last chunk of a turn). */
export type FinishReason = "eos" | "length" | "stop" | "context" | "tool_calls";
export const FinishReason = {
  /** The model ended its turn. */
  EOS: "eos",
  /** `sampleLen` reached. */
  LENGTH: "length",
  /** A stop sequence matched; it is not part of the text. */
  STOP: "stop",
  /** The session's context window is full. */
  CONTEXT: "context",
  /** The reply ended with complete tool calls. */
  TOOL_CALLS: "tool_calls",
} as const satisfies Record<string, FinishReason>;

/** A call the model made; `arguments` is JSON text matching the tool's parameters. */
export interface ToolCall {
  readonly id: string;
  readonly name: string;
  readonly arguments: string;
}

/**
 * A function the model may call. `parameters` is the arguments' JSON Schema (type object), as
 * an object or JSON text; the server builds a grammar from it, so calls validate.
 */
export interface Tool {
  readonly name: string;
  readonly description?: string;
  readonly parameters?: object | string;
}

/**
 * A piece of call `index` of a streamed reply: `id` and `name` come with its first piece only
 * (empty on the others); the `arguments` pieces, joined, are the call's.
 */
export interface ToolCallDelta {
  readonly index: number;
  readonly id: string;
  readonly name: string;
  readonly arguments: string;
}

/**
 * One message of the conversation. The caller owns the history and sends all of it every
 * turn: the server's session is only a cache of it (hot-loop's model).
 */
export interface Message {
  readonly role: Role;
  readonly content: string;
  /** An assistant message's calls (`content`: the text before them, often empty). */
  readonly toolCalls?: readonly ToolCall[];
  /** A `"tool"` message: the id of the call it is the result of. */
  readonly toolCallId?: string;
}

/** A `Message`, or a `[role, content]` pair such as `["user", "hi"]`. */
export type MessageLike = Message | readonly [Role, string];

/** A conversation, oldest message first. */
export type HistoryLike = Iterable<MessageLike>;

/**
 * Sampling settings of a session; an absent (`undefined`) field means "not set": the
 * server's default, or in a per-turn override, the session's value. Mirrors
 * `hotloop.v1.Settings`.
 *
 * The server validates the values (INVALID_ARGUMENT names the bad field), so the SDK does not
 * duplicate its bounds here and cannot drift from them.
 */
export interface Settings {
  /** >= 0; 0 means greedy decoding. Server default 0.8. */
  readonly temperature?: number;
  /** Maximum tokens generated per turn, >= 1. Server default 256. */
  readonly sampleLen?: number;
  /** Fixed seed (reproducible replies); absent draws a fresh seed every turn. uint64. */
  readonly seed?: number | bigint;
  /** Nucleus sampling, in (0, 1]. */
  readonly topP?: number;
  /** >= 0; 0 disables top-k. */
  readonly topK?: number;
  /** > 0; 1.0 disables it. */
  readonly repeatPenalty?: number;
  /** Tokens the repeat penalty looks back over. */
  readonly repeatLastN?: number;
  /** Generation ends before any of these strings (at most 8). */
  readonly stop?: readonly string[];
  /** In [0, 1). */
  readonly minP?: number;
  /** Drop the oldest turns (system prompt kept) instead of failing with OUT_OF_RANGE. */
  readonly truncateHistory?: boolean;
  /** Structured output: a GBNF grammar (llama.cpp's syntax, start symbol `root`) every reply matches. */
  readonly grammar?: string;
  /** Structured output: a JSON Schema (JSON text) every reply matches; `'{"type": "object"}'`: any object. */
  readonly jsonSchema?: string;
  /** Report each generated token's log-probability (`Chunk.logprobs`). */
  readonly logprobs?: boolean;
  /** With `logprobs`: also the most likely alternatives at each position, 0-20. */
  readonly topLogprobs?: number;
}

/** The names of the `Settings` fields, in the proto's order. */
export const SETTINGS_FIELDS = [
  "temperature",
  "sampleLen",
  "seed",
  "topP",
  "topK",
  "repeatPenalty",
  "repeatLastN",
  "stop",
  "minP",
  "truncateHistory",
  "grammar",
  "jsonSchema",
  "logprobs",
  "topLogprobs",
] as const satisfies readonly (keyof Settings)[];

/** Where a request's prompt tokens came from and how many it generated. */
export interface Usage {
  /** Tokens of the rendered history. */
  readonly promptTokens: number;
  /** Reused from the session's hot KV cache (or a shared prefix). */
  readonly cachedTokens: number;
  /** Restored from host RAM after an eviction. */
  readonly restoredTokens: number;
  /** Computed for this request. */
  readonly prefilledTokens: number;
  /** Generated. */
  readonly completionTokens: number;
}

/** Server-side timings of one request, in milliseconds. */
export interface Timings {
  readonly queueMs: number;
  readonly prefillMs: number;
  readonly timeToFirstTokenMs: number;
  /** From the first to the last generated token. */
  readonly decodeMs: number;
}

/** Which replica served a request and whether the session's cache was there. */
export interface ServedBy {
  readonly replica: string;
  readonly replicaRank: number;
  readonly cacheHit: boolean;
}

/**
 * One generated token: its id, bytes and natural-log probability under the model's raw
 * distribution; `top`: the most likely alternatives at its position (`topLogprobs`), best first.
 */
export interface TokenLogprob {
  readonly token: number;
  /** The token's bytes (a token may hold part of a UTF-8 character). */
  readonly piece: Uint8Array;
  readonly logprob: number;
  readonly top: readonly { readonly token: number; readonly piece: Uint8Array; readonly logprob: number }[];
}

/**
 * A piece of a streamed reply. Only the last chunk of a turn carries `finishReason`,
 * `usage`, `timings` and `servedBy`; on the others they are `undefined`.
 */
export interface Chunk {
  readonly text: string;
  readonly finishReason?: FinishReason;
  readonly usage?: Usage;
  readonly timings?: Timings;
  readonly servedBy?: ServedBy;
  /** With `Settings.logprobs`: the tokens generated since the previous chunk (else empty). */
  readonly logprobs: readonly TokenLogprob[];
  /** With `tools`: pieces of the reply's calls (`text` never holds call syntax). */
  readonly toolCalls: readonly ToolCallDelta[];
  /** True on the chunk that ends the turn. */
  readonly isLast: boolean;
}

/** What the server knows of one served model (`ModelService.GetModel`). */
export interface ModelInfo {
  readonly name: string;
  /** `general.architecture`, e.g. "gemma3". */
  readonly architecture: string;
  /** Tokens one session may hold. */
  readonly contextLength: number;
  readonly trainContextLength: number;
  /** E.g. "Q4_K_M". */
  readonly quantization: string;
  readonly hasChatTemplate: boolean;
  /** "gguf" or "builtin:<name>". */
  readonly chatTemplateSource: string;
  readonly parameters: number;
  readonly sizeBytes: number;
  readonly vocabSize: number;
  /** Configured replicas (or the autoscaling minimum). */
  readonly replicas: number;
}

/** The server's view of a session (`SessionService.GetSession`). */
export interface SessionInfo {
  readonly id: string;
  readonly model: string;
  /** The session's settings with every field the server fills in. */
  readonly settings: Settings;
  /** Tokens held in the session's KV cache (hot or evicted). */
  readonly contextTokens: number;
  /** "new", "hot", "evicted" or "dropped". */
  readonly state: string;
  readonly servedBy?: ServedBy;
  /** When the session last served a request (Unix seconds; 0 if never). */
  readonly lastUsed: number;
}
