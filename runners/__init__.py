"""What runs on a host (Docker, Modal, device scripts); remnant itself never imports it."""
