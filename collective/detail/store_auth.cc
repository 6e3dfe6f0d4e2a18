// The TCP store's handshake proofs (store_auth.h), on OpenSSL's libcrypto.
#include "tandem/collective/detail/store_auth.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <cstdint>

#include "tandem/base/env.h"
#include "tandem/base/errors.h"

namespace tandem::collective::detail::auth {
namespace {

void append_with_length(std::string& out, std::string_view field) {
  const auto n = static_cast<std::uint32_t>(field.size());
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((n >> (8 * i)) & 0xff));
  out.append(field);
}

}  // namespace

std::string random_bytes(std::size_t size) {
  std::string out(size, '\0');
  if (size > 0 && RAND_bytes(reinterpret_cast<unsigned char*>(out.data()), static_cast<int>(size)) != 1) {
    throw Internal("the TCP store: the system's random generator failed (RAND_bytes)");
  }
  return out;
}

std::string proof(Side side, std::string_view secret, std::string_view server_nonce, std::string_view client_nonce) {
  std::string message(side == Side::kClient ? "tandem store v1: client proof" : "tandem store v1: server proof");
  message.push_back('\0');
  append_with_length(message, server_nonce);
  append_with_length(message, client_nonce);
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  // HMAC's key may be empty; a store without a secret never asks for a proof anyway.
  static const unsigned char kNoKey = 0;
  const void* key = secret.empty() ? static_cast<const void*>(&kNoKey) : static_cast<const void*>(secret.data());
  if (HMAC(EVP_sha256(), key, static_cast<int>(secret.size()), reinterpret_cast<const unsigned char*>(message.data()),
           message.size(), digest, &length) == nullptr) {
    return std::string();  // matches no offered proof (proofs_equal requires kProofBytes)
  }
  return std::string(reinterpret_cast<const char*>(digest), length);
}

bool proofs_equal(std::string_view offered, std::string_view expected) {
  // The lengths are public (kProofBytes); only the contents must not leak through timing.
  if (offered.size() != kProofBytes || expected.size() != kProofBytes) return false;
  return CRYPTO_memcmp(offered.data(), expected.data(), kProofBytes) == 0;
}

std::string resolve_secret(const std::string& option) {
  return option.empty() ? env::get_string(env::kStoreSecret) : option;
}

}  // namespace tandem::collective::detail::auth
