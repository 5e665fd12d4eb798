"""The file system the kernel sees: the FUSE operations (fs) that turn the kernel's requests into calls
on the namespace, the cache and write-back. It imports those rooms and the kernel's protocol; nothing of
control, the daemon or the command line."""
