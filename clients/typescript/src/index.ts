/**
 * @hotloop/client: the TypeScript client of hotloop-serve (gRPC through Ray Serve's proxy).
 *
 * ```ts
 * import { Client } from "@hotloop/client";
 *
 * const client = new Client("127.0.0.1:9000");
 * const session = await client.model("gemma-3-270m").newSession({ settings: { seed: 1 } });
 * for await (const chunk of session.generate([{ role: "user", content: "Hello!" }])) {
 *   process.stdout.write(chunk.text);
 * }
 * client.close();
 * ```
 *
 * Everything public is exported here; other modules may change at any time.
 */

export { Client, Model, Session } from "./client";
export type { CallOptions, ClientOptions, GenerateOptions, NewSessionOptions } from "./client";
export {
  Cancelled,
  DeadlineExceeded,
  errorForStatus,
  FailedPrecondition,
  HotloopError,
  InternalError,
  InvalidArgument,
  NotFound,
  OutOfRange,
  PermissionDenied,
  ResourceExhausted,
  Status,
  TurnInterrupted,
  Unauthenticated,
  Unavailable,
} from "./errors";
export { FinishReason, Role } from "./types";
export { assistantMessage, IMPORT_PART_BYTES, withMessageReplaced, withoutLastReply } from "./base";
export type { ToolOptions } from "./base";
export type {
  Chunk,
  HistoryLike,
  Message,
  MessageLike,
  ModelInfo,
  ServedBy,
  SessionInfo,
  Settings,
  Timings,
  TokenLogprob,
  Tool,
  ToolCall,
  ToolCallDelta,
  Usage,
} from "./types";

export const VERSION = "0.1.0";
