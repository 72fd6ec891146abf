// blakejs ships no type declarations; this is the one function the SDK uses.
declare module "blakejs" {
  /** BLAKE2b of `input` with an optional `key` and an output of `outlen` bytes (1-64). */
  export function blake2b(input: Uint8Array | string, key?: Uint8Array, outlen?: number): Uint8Array;
}
