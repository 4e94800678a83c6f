"""Images in chat requests: image parts read, fetched under an SSRF guard, decoded, checked."""
