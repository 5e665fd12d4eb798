"""Entry points the node's own tooling calls: mount.epochfs for /etc/fstab and systemd mount units
(fstab), Fluid's mount script (fluid). They sit above the command line and the daemon, below nothing."""
