# The Twilio auth token reaches the container only through the task definition's `secrets`
# (ECS reads it with the execution role at task start), never as a plain environment value and
# never in Terraform state: the secret is created empty and its value set out of band:
#   aws secretsmanager put-secret-value --secret-id <output twilio_auth_token_secret_arn> \
#     --secret-string "$TWILIO_AUTH_TOKEN"
# A task cannot start until the secret has a value (see infra/README.md, apply steps).

resource "aws_secretsmanager_secret" "twilio_auth_token" {
  count = var.twilio_auth_token_secret_arn == null ? 1 : 0

  name_prefix             = "${var.name}/twilio-auth-token-"
  description             = "Twilio auth token of ${var.name} (GATEWAY_TWILIO_AUTH_TOKEN); value set out of band"
  kms_key_id              = var.secrets_kms_key_arn
  recovery_window_in_days = 7
}

locals {
  twilio_auth_token_secret_arn = var.twilio_auth_token_secret_arn != null ? var.twilio_auth_token_secret_arn : aws_secretsmanager_secret.twilio_auth_token[0].arn

  # Container secrets: environment name -> whole-secret ARN. The execution role may read exactly
  # these ARNs (iam.tf) and nothing else.
  gateway_secrets = {
    GATEWAY_TWILIO_AUTH_TOKEN = local.twilio_auth_token_secret_arn
  }
  sip_secrets = {
    GATEWAY_SIP_USERS = var.sip_users_secret_arn
  }
  container_secrets = merge(
    local.gateway_secrets,
    var.sip_enabled && var.sip_users_secret_arn != null ? local.sip_secrets : {},
  )
}
