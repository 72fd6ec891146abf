/**
 * The SDK's error hierarchy, and the one function that turns gRPC errors into it.
 *
 * Callers catch these instead of grpc-js `ServiceError`s so that their code does not depend
 * on the transport, and so that `err instanceof NotFound` reads like the API contract. The
 * tree mirrors the server's (and the Python SDK's) status by status:
 *
 *     HotloopError                        any failed request; .code, .details
 *     ├── InvalidArgument      INVALID_ARGUMENT     bad settings, empty history, unknown role
 *     ├── NotFound             NOT_FOUND            unknown model or session
 *     ├── OutOfRange           OUT_OF_RANGE         history longer than the context window
 *     ├── ResourceExhausted    RESOURCE_EXHAUSTED   overload, session limits
 *     ├── FailedPrecondition   FAILED_PRECONDITION  the session is busy with another request
 *     ├── Unauthenticated      UNAUTHENTICATED      missing or wrong bearer token
 *     ├── PermissionDenied     PERMISSION_DENIED    the session belongs to another principal
 *     ├── Cancelled            CANCELLED            the request was cancelled (e.g. AbortSignal)
 *     ├── DeadlineExceeded     DEADLINE_EXCEEDED    the call's timeout passed
 *     ├── Unavailable          UNAVAILABLE          server unreachable or a replica failed
 *     │   └── TurnInterrupted                       a reply broke off midway; retry the turn
 *     └── InternalError        INTERNAL             a server bug (or UNKNOWN, DATA_LOSS)
 *
 * Statuses with no class of their own (UNIMPLEMENTED, ABORTED, ALREADY_EXISTS) throw the base
 * class with `.code` set, so nothing is silently re-labelled.
 *
 * The server also sends gRPC's richer error model (a `google.rpc.Status` in the
 * `grpc-status-details-bin` trailer, decoded with the code generated from the vendored
 * protos/google/rpc): `.reason` (a constant such as `SESSION_NOT_FOUND`), `.fieldViolations`
 * (`[field, description]`: fix your request) and `.retryDelayMs` (the same request may be retried),
 * so callers never parse `.details`.
 */

import { status as Status } from "@grpc/grpc-js";

import { BadRequest, ErrorInfo, RetryInfo } from "./gen/google/rpc/error_details";
import { Status as RpcStatus } from "./gen/google/rpc/status";

export { Status };

function statusName(code: Status): string {
  return Status[code] ?? String(code);
}

/** A request failed. `code` is the gRPC status code; `details` the server's text. */
export class HotloopError extends Error {
  /** The status this class stands for (`undefined` on the base class). */
  static readonly statusCode: Status | undefined = undefined;

  /** The gRPC status code (`Status.NOT_FOUND`, ...). */
  readonly code: Status;
  /** The server's (or the transport's) description of the failure. */
  readonly details: string;
  /** `ErrorInfo.reason` from the server (`SESSION_NOT_FOUND`, `INVALID_SETTING`...). */
  reason: string | undefined = undefined;
  /** `BadRequest`: the request fields at fault, with why. */
  fieldViolations: readonly (readonly [string, string])[] = [];
  /** `RetryInfo`: milliseconds after which the same request may succeed; undefined: do not retry as is. */
  retryDelayMs: number | undefined = undefined;

  constructor(details: string, code?: Status, options?: { cause?: unknown }) {
    const resolved = code ?? (new.target as typeof HotloopError).statusCode ?? Status.UNKNOWN;
    super(details ? `${statusName(resolved)}: ${details}` : statusName(resolved), options);
    this.name = new.target.name;
    this.code = resolved;
    this.details = details;
  }

  /** The status code's name, e.g. "NOT_FOUND". */
  get codeName(): string {
    return statusName(this.code);
  }
}

/** The request was malformed: bad settings, empty history, unknown role. */
export class InvalidArgument extends HotloopError {
  static override readonly statusCode: Status = Status.INVALID_ARGUMENT;
}

/** The model or session does not exist (or is not the caller's). */
export class NotFound extends HotloopError {
  static override readonly statusCode: Status = Status.NOT_FOUND;
}

/** The history does not fit the context window (see `Settings.truncateHistory`). */
export class OutOfRange extends HotloopError {
  static override readonly statusCode: Status = Status.OUT_OF_RANGE;
}

/** The server hit a bound (queue, sessions, memory); retrying later may succeed. */
export class ResourceExhausted extends HotloopError {
  static override readonly statusCode: Status = Status.RESOURCE_EXHAUSTED;
}

/** The session cannot take this request now (e.g. it is busy with another one). */
export class FailedPrecondition extends HotloopError {
  static override readonly statusCode: Status = Status.FAILED_PRECONDITION;
}

/** The bearer token is missing or wrong. */
export class Unauthenticated extends HotloopError {
  static override readonly statusCode: Status = Status.UNAUTHENTICATED;
}

/** The caller may not use this session or model. */
export class PermissionDenied extends HotloopError {
  static override readonly statusCode: Status = Status.PERMISSION_DENIED;
}

/**
 * The request was cancelled: by the caller's `AbortSignal` (then `cause` is the signal's
 * `reason`), or by the server.
 */
export class Cancelled extends HotloopError {
  static override readonly statusCode: Status = Status.CANCELLED;
}

/** The call's `timeoutMs` passed before the server finished. */
export class DeadlineExceeded extends HotloopError {
  static override readonly statusCode: Status = Status.DEADLINE_EXCEEDED;
}

/**
 * The server could not be reached, or the replica serving the request failed.
 *
 * The SDK already retried once where that was safe; retrying later may succeed.
 */
export class Unavailable extends HotloopError {
  static override readonly statusCode: Status = Status.UNAVAILABLE;
}

/**
 * A streamed reply broke off after some text had reached the caller.
 *
 * The SDK cannot retry this itself without showing the caller the same text twice, but the
 * turn is safe to retry: send the same history again (the server rebuilds the session's cache
 * from it on a live replica). `partialText` is what was received before the break.
 */
export class TurnInterrupted extends Unavailable {
  /** The text delivered before the reply broke off. */
  readonly partialText: string;

  constructor(details: string, partialText: string, code?: Status, options?: { cause?: unknown }) {
    super(
      `the reply was interrupted after ${partialText.length} characters (${details}); ` +
        "retry the turn with the same history",
      code,
      options,
    );
    this.partialText = partialText;
  }
}

/** The server failed in a way it did not expect: a bug worth reporting. */
export class InternalError extends HotloopError {
  static override readonly statusCode: Status = Status.INTERNAL;
}

type ErrorClass = new (details: string, code?: Status, options?: { cause?: unknown }) => HotloopError;

const BY_CODE = new Map<Status, ErrorClass>([
  [Status.INVALID_ARGUMENT, InvalidArgument],
  [Status.NOT_FOUND, NotFound],
  [Status.OUT_OF_RANGE, OutOfRange],
  [Status.RESOURCE_EXHAUSTED, ResourceExhausted],
  [Status.FAILED_PRECONDITION, FailedPrecondition],
  [Status.UNAUTHENTICATED, Unauthenticated],
  [Status.PERMISSION_DENIED, PermissionDenied],
  [Status.CANCELLED, Cancelled],
  [Status.DEADLINE_EXCEEDED, DeadlineExceeded],
  [Status.UNAVAILABLE, Unavailable],
  [Status.INTERNAL, InternalError],
  // Statuses that mean "the server broke" without being INTERNAL.
  [Status.UNKNOWN, InternalError],
  [Status.DATA_LOSS, InternalError],
]);

/** The one place a gRPC status becomes an SDK error. */
export function errorForStatus(code: Status, details: string, options?: { cause?: unknown }): HotloopError {
  const Cls = BY_CODE.get(code) ?? HotloopError;
  return new Cls(details, code, options);
}

/** A grpc-js `ServiceError` (or anything shaped like one: a numeric `code`, string `details`). */
export interface StatusLike {
  code: number;
  details?: string;
}

/** Whether `err` carries a gRPC status. */
export function isStatusError(err: unknown): err is StatusLike & Error {
  return (
    err instanceof Error &&
    typeof (err as Partial<StatusLike>).code === "number" &&
    !(err instanceof HotloopError)
  );
}

/** The `[code, details]` of a gRPC error; anything else reads as UNKNOWN with its message. */
export function statusOf(err: unknown): [Status, string] {
  if (err instanceof HotloopError) return [err.code, err.details];
  if (isStatusError(err)) return [err.code as Status, String(err.details ?? "")];
  return [Status.UNKNOWN, err instanceof Error ? err.message : String(err)];
}

/** The trailer carrying the serialized `google.rpc.Status` (gRPC's richer error model). */
export const DETAILS_KEY = "grpc-status-details-bin";

/** What a `google.rpc.Status` trailer says, when the server sent one (Ray's own errors do not). */
export interface RichDetails {
  reason: string | undefined;
  fieldViolations: (readonly [string, string])[];
  retryDelayMs: number | undefined;
}

/** The rich details of a gRPC error; empty when it has no (or a mismatched) trailer. */
export function richDetails(err: unknown): RichDetails {
  const out: RichDetails = { reason: undefined, fieldViolations: [], retryDelayMs: undefined };
  const metadata = (err as { metadata?: { get?: (key: string) => unknown[] } } | null)?.metadata;
  const raw = metadata?.get?.(DETAILS_KEY)?.[0];
  if (!(raw instanceof Uint8Array)) return out;
  let status: RpcStatus;
  try {
    status = RpcStatus.decode(raw);
  } catch {
    return out;
  }
  if (status.code !== statusOf(err)[0]) return out; // a trailer that does not match the status
  for (const detail of status.details) {
    const type = detail.typeUrl.slice(detail.typeUrl.lastIndexOf("/") + 1);
    try {
      if (type === "google.rpc.ErrorInfo") {
        out.reason = ErrorInfo.decode(detail.value).reason;
      } else if (type === "google.rpc.BadRequest") {
        for (const v of BadRequest.decode(detail.value).fieldViolations) out.fieldViolations.push([v.field, v.description]);
      } else if (type === "google.rpc.RetryInfo") {
        const delay = RetryInfo.decode(detail.value).retryDelay;
        out.retryDelayMs = delay ? Number(delay.seconds) * 1000 + delay.nanos / 1e6 : 0;
      }
    } catch {
      // a detail that does not decode is skipped
    }
  }
  return out;
}

/** Translate a grpc-js `ServiceError` into the hierarchy above, with its rich details (SDK errors pass through). */
export function fromRpcError(err: unknown): HotloopError {
  if (err instanceof HotloopError) return err;
  const [code, details] = statusOf(err);
  const error = errorForStatus(code, details, { cause: err });
  const rich = richDetails(err);
  error.reason = rich.reason;
  error.fieldViolations = rich.fieldViolations;
  error.retryDelayMs = rich.retryDelayMs;
  return error;
}
