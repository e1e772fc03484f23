# SIP entry point, only with sip_enabled: an NLB with a UDP listener on 5060 and an Elastic IP
# per zone (trunks want fixed addresses), forwarding to the gateway hosts' port 5060. Its target
# group is health-checked over HTTP on the gateway port (/readyz), since UDP has no health check
# of its own; a warming-up or draining task therefore gets no new SIP flows either.
#
# What the NLB does and does not carry (limits, see infra/README.md):
# - Only the dialog-creating request goes through it. The gateway's Contact and SDP carry the
#   host's own public IP (GATEWAY_SIP_PUBLIC_IP), so ACK/BYE and all RTP go straight to the
#   host that took the call; the security group admits them from the trunk's CIDRs only.
#   Carrying RTP through the NLB would take a listener per port (a 1000-port range against a
#   limit of 50 listeners per NLB), and the NLB's per-flow hashing could send a call's media to
#   a different task than its signalling.
# - UDP is balanced per flow (source and destination address and port): a trunk that signals
#   from one address and port lands every INVITE on the same task until that flow idles out
#   or the task deregisters. Spread calls with several trunk source ports/addresses, or point
#   the trunk at the hosts' addresses with DNS SRV instead.
# - A UDP flow ends only by idling out, and a trunk that sends OPTIONS keep-alives never lets it
#   idle: a deregistering task keeps receiving that flow's INVITEs (and accepts them, it is not
#   draining until SIGTERM) for the whole deregistration delay. Hence a short delay of its own
#   (sip_deregistration_delay_s) with connection_termination: then the flow ends and the next
#   INVITE picks another task. For SIP across many replicas, the Kamailio proxy in infra/sip/
#   balances per call and probes each gateway with OPTIONS instead.

resource "aws_eip" "sip" {
  count = var.sip_enabled ? length(local.public_subnet_ids) : 0

  domain = "vpc"
  tags   = { Name = "${var.name}-sip-${count.index}" }
}

resource "aws_security_group" "nlb" {
  count = var.sip_enabled ? 1 : 0

  name        = "${var.name}-nlb"
  description = "SIP NLB of ${var.name}: UDP 5060 from the trunk, health checks to the hosts"
  vpc_id      = local.vpc_id
  tags        = { Name = "${var.name}-nlb" }
}

resource "aws_vpc_security_group_ingress_rule" "nlb_sip" {
  for_each = var.sip_enabled ? toset(var.sip_trunk_cidrs) : toset([])

  security_group_id = aws_security_group.nlb[0].id
  description       = "SIP over UDP from the trunk"
  ip_protocol       = "udp"
  from_port         = local.sip_port
  to_port           = local.sip_port
  cidr_ipv4         = each.value
}

resource "aws_vpc_security_group_egress_rule" "nlb_sip_to_hosts" {
  count = var.sip_enabled ? 1 : 0

  security_group_id            = aws_security_group.nlb[0].id
  description                  = "SIP over UDP to the gateway hosts"
  ip_protocol                  = "udp"
  from_port                    = local.sip_port
  to_port                      = local.sip_port
  referenced_security_group_id = aws_security_group.gpu_hosts.id
}

resource "aws_vpc_security_group_egress_rule" "nlb_health_to_hosts" {
  count = var.sip_enabled ? 1 : 0

  security_group_id            = aws_security_group.nlb[0].id
  description                  = "Health checks: /readyz on the gateway port"
  ip_protocol                  = "tcp"
  from_port                    = var.container_port
  to_port                      = var.container_port
  referenced_security_group_id = aws_security_group.gpu_hosts.id
}

resource "aws_lb" "sip" {
  count = var.sip_enabled ? 1 : 0

  name               = "${var.name}-sip"
  load_balancer_type = "network"
  internal           = false
  security_groups    = [aws_security_group.nlb[0].id]

  dynamic "subnet_mapping" {
    for_each = local.public_subnet_ids
    content {
      subnet_id     = subnet_mapping.value
      allocation_id = aws_eip.sip[subnet_mapping.key].id
    }
  }
}

resource "aws_lb_target_group" "sip" {
  count = var.sip_enabled ? 1 : 0

  name        = "${var.name}-sip"
  vpc_id      = local.vpc_id
  protocol    = "UDP"
  port        = local.sip_port
  target_type = "instance" # host network mode; UDP keeps the trunk's source address

  # See sip_deregistration_delay_s: end the trunk's flow to a leaving task soon, so the next
  # INVITE hashes to another task; its established calls are unaffected.
  deregistration_delay   = var.sip_deregistration_delay_s
  connection_termination = true

  health_check {
    protocol            = "HTTP"
    port                = tostring(var.container_port)
    path                = "/readyz"
    matcher             = "200"
    interval            = 10
    timeout             = 5
    healthy_threshold   = 2
    unhealthy_threshold = 2
  }
}

resource "aws_lb_listener" "sip" {
  count = var.sip_enabled ? 1 : 0

  load_balancer_arn = aws_lb.sip[0].arn
  port              = local.sip_port
  protocol          = "UDP"

  default_action {
    type             = "forward"
    target_group_arn = aws_lb_target_group.sip[0].arn
  }
}
