// tandem/collective/detail/store_auth.h — the TCP store's handshake proofs: random nonces and
// tokens, HMAC-SHA256 proofs of a shared secret, their constant-time comparison, and where the
// secret comes from. The server's service (store_service.cc) and the client (tcp_store_client.cc)
// use them; libcrypto (OpenSSL) does the cryptography. Not part of the public contract.
//
// The handshake (frames in store_wire.h): the server sends a fresh random nonce Ns; the client
// answers with its own nonce Nc and proof(kClient, secret, Ns, Nc); the server checks it and
// answers with proof(kServer, secret, Ns, Nc), which the client checks in turn. Each side's nonce
// makes every proof single-use, and the side label keeps a proof of one direction from passing
// for the other, so a peer without the secret can neither answer a challenge nor replay or
// reflect an earlier answer. Nothing here throws except random_bytes, when the system's random
// generator fails (Internal).
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace tandem::collective::detail::auth {

constexpr std::size_t kNonceBytes = 32;
constexpr std::size_t kProofBytes = 32;  // HMAC-SHA256
constexpr std::size_t kTokenBytes = 16;  // a session token (store_wire.h's JOIN)

// `size` cryptographically random bytes (RAND_bytes).
std::string random_bytes(std::size_t size);

enum class Side { kClient, kServer };
// HMAC-SHA256 keyed by the secret over the side's label and both nonces (each with its length).
std::string proof(Side side, std::string_view secret, std::string_view server_nonce, std::string_view client_nonce);
// Whether the offered proof is the expected one, in a time that does not depend on where they
// differ (CRYPTO_memcmp): a wrong guess teaches nothing about the right one.
bool proofs_equal(std::string_view offered, std::string_view expected);

// The secret a store uses: `option` when not empty, else TANDEM_STORE_SECRET (base/env.h), else
// none (empty: no authentication).
std::string resolve_secret(const std::string& option);

}  // namespace tandem::collective::detail::auth
